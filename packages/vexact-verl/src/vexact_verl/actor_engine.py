"""The invariant actor: ``actor_rollout_ref.actor.strategy=vexact`` (and the ref's) in verl 0.9.1.

verl builds the actor's and the ref's model engines with ``EngineRegistry.new(model_type, backend=actor.strategy)``
(``verl/workers/engine_workers.py``). :func:`register_engine` adds ``backend="vexact"`` for ``language_model``:
:class:`VexactEngineWithLMHead`, a subclass of verl's ``FSDPEngineWithLMHead`` that changes three hooks and keeps
the rest of verl's engine (device mesh, micro-batching, optimizer and LR scheduler, train/eval contexts, offload,
``get_per_tensor_param`` weight export):

- ``_build_module``: ``vexact_models.load_model`` on the same HF checkpoint (``model.path``), in verl's
  ``model_dtype`` (fp32 master weights for the actor). Parameter names are Hugging Face's, so FSDP2 state dicts and
  the per-tensor weight export carry the names the rollout expects.
- ``_build_fsdp_module``: verl's own FSDP2 helpers (``apply_fsdp2`` picks the decoder layers, embedding and
  lm_head; ``fsdp2_load_full_state_dict``), with the trainer's mixed precision: bf16 parameters, fp32 gradient
  reduction and ``cast_forward_inputs=False`` (a per-token fp32 temperature must reach the logprob kernel as
  fp32). ``logits``/``logprobs`` are registered as FSDP forward methods so the head is unsharded for them.
- ``forward_step``: verl's packed micro-batch (jagged ``input_ids``/``position_ids``, per-sample temperature) goes
  through :func:`vexact_verl.actor.packed_log_probs`, i.e. the model's forward and ``model.logprobs`` on the
  vexact kernels, with no autocast; ``log_probs`` / ``entropy`` come back in verl's nested layout.

What the engine refuses, by name, instead of silently computing something else: LoRA, QAT, Ulysses sequence
parallelism, Liger/fused-kernel options, activation offload, ``calculate_sum_pi_squared``, top-k distillation,
multimodal inputs, 3-D (mrope) position ids, model types vexact-models does not define, and non-bf16/fp32 mixed
precision. verl's checkpoint save/load work (the HF config saved beside it is the checkpoint's own), ``hf_model`` in
``checkpoint.save_contents`` included.

Tested on CPU (``tests/test_verl_actor_engine.py``) with verl's engine constructed for real on a gloo world-size-1
group; the only thing the test replaces is verl's platform singleton (a CPU platform, in the slot verl's
``set_platform`` fills), because verl 0.9.1 has no CPU platform. The same tests' ``cuda`` variants (``-m gpu``) run the
path on verl's CUDA platform.

verl's ``old_log_prob`` is timed on this side: ``infer_batch`` and its micro-batches' forwards (synchronised), logged
by the next training step as ``actor/vexact/perf/infer_batch_s``, ``actor/vexact/perf/infer_forward_s`` and
``actor/vexact/perf/infer_micro_batches``; the rest of verl's ``timing_s/old_log_prob`` is verl's dispatch and
collection (``benchmarks/old_log_prob.py`` times it phase by phase on CPU, for this engine and verl's own).

``train_batch`` also runs the TIM attribution by op family on a sample of the step's sequences when the engine
config's ``vexact.tim_attribute_every`` asks for it (off by default; :class:`VexactFSDPEngineConfig`,
:mod:`vexact_verl.tim`), adding ``tim_attr/*`` to the step's metrics without touching the step's numerics.

In verl's async trainers, ``infer_batch`` (verl's ``old_log_prob``) also checks the behavior policy per version
(:meth:`VexactEngineWithLMHead.check_versions`) where the batch carries each token's policy version
(:class:`vexact_verl.agent_loop.VersionedAgentLoopManager`): the tokens of the version the actor holds (the one it
last published, :func:`vexact_verl.versions.published_version`) are compared with the logprobs just computed, at no
extra cost; with ``vexact.keep_previous_version=true`` the actor also keeps the previous version's weights on the host
(one more copy of its parameter shards) and rescores the tokens of that version with them (one more forward). The
next training step logs ``actor/vexact/behavior/*`` (K3 of those tokens: exactly 0.0) and ``actor/vexact/staleness/*``
(versions behind, over all tokens), beside verl's ``rollout_corr/*`` against the current weights.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id, get_device_name
from verl.utils.model import extract_multi_modal_inputs
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.config import FSDPEngineConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import detach_tree
from verl.workers.utils.padding import no_padding_2_padding

import vexact_kernels as vk
import vexact_models

from .actor import packed_log_probs
from .tim import AttributionConfig, attribution_metrics
from .versions import TOKEN_VERSIONS, behavior_check, published_version, staleness_metrics

ENGINE_BACKEND = "vexact"
MODEL_TYPE = "language_model"
# verl looks an engine up by the platform's device name; "cpu" is reached only where a CPU platform is set
# (verl 0.9.1 ships none: the tests set one), since vexact's kernels have an exact CPU path.
DEVICES = ("cuda", "cpu")
KEY_KEEP_PREVIOUS = "keep_previous_version"


@dataclass
class VexactFSDPEngineConfig(FSDPEngineConfig):
    """verl's ``FSDPEngineConfig`` with a ``vexact`` section: the settings of the vexact actor engine that verl's
    schema has no field for (the TIM attribution: ``tim_attribute_every``, ``tim_attribute_samples``,
    ``tim_attribute_ops``; :class:`vexact_verl.tim.AttributionConfig`) and ``keep_previous_version`` (bool, off: keep
    the previous policy version's weights on the host to check its tokens exactly). Set it as the ``_target_`` of
    ``actor_rollout_ref.actor.fsdp_config`` and add keys with
    ``+actor_rollout_ref.actor.fsdp_config.vexact.KEY=...``."""

    vexact: dict[str, Any] = field(default_factory=dict)


class VexactEngineWithLMHead(FSDPEngineWithLMHead):
    """verl's FSDP LM-head engine with the vexact model and kernels (see the module docstring)."""

    # "fast" scores with cuBLAS/SDPA-style kernels (the mismatch baseline); "invariant" is the point.
    kernel_backend: str = "invariant"
    logprob_chunk_size: int = 1024

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        _check_supported(model_config, engine_config)
        settings = dict(getattr(engine_config, "vexact", None) or {})  # a plain FSDPEngineConfig has no vexact section
        keep = settings.get(KEY_KEEP_PREVIOUS, False)
        if not isinstance(keep, bool):
            raise ValueError(f"vexact.{KEY_KEEP_PREVIOUS} must be true or false, got {keep!r}")
        self.keep_previous_version = keep
        self._held_versions: dict[int, tuple] = {}  # version -> host copy of this rank's parameter shards
        self._version_metrics: list[dict] = []  # from infer_batch, logged by the next train_batch
        self._infer_timing: dict[str, float] = {}  # infer_batch's time since the last step, logged by the next one
        # off unless the config's vexact.tim_attribute_every >= 1
        self.tim_attribution = AttributionConfig.from_settings(settings, other_keys=(KEY_KEEP_PREVIOUS,))
        self._tim_step = 0  # training steps begun (verl's update_actor: one step, one or more train_batch calls)
        self._tim_step_open = False
        if not engine_config.full_determinism:
            # verl seeds the process's RNGs only under full_determinism, which also pins NCCL's algorithm and protocol
            # (slower all-gathers) and turns on torch's deterministic mode: seed them alone, so that the RNG states
            # verl saves in a checkpoint are the same in two runs of a job (the invariant kernels need nothing else)
            random.seed(engine_config.seed)
            np.random.seed(engine_config.seed)
            torch.manual_seed(engine_config.seed)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    def _build_module(self):
        dtype = self.engine_config.model_dtype
        if dtype is None:
            dtype = "fp32" if not self.engine_config.forward_only else "bf16"
        module = vexact_models.load_model(self.model_config.local_path, dtype=PrecisionType.to_dtype(dtype))
        # verl's FSDP2 helper wraps the classes named here (HF models carry the same attribute)
        module._no_split_modules = [type(module.model.layers[0]).__name__]
        module.requires_grad_(not self.engine_config.forward_only)
        if self.model_config.enable_gradient_checkpointing and not self.engine_config.forward_only:
            # composable checkpoint: hooks, no wrapper module, so parameter names stay Hugging Face's; the
            # invariant kernels are deterministic, so the recomputation is the forward, bit for bit
            from torch.distributed._composable import checkpoint

            for layer in module.model.layers:
                checkpoint(layer)
        return module

    def _build_fsdp_module(self, module):
        from torch.distributed.fsdp import register_fsdp_forward_method
        from verl.utils.fsdp_utils import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            apply_fsdp2,
            fsdp2_load_full_state_dict,
        )

        mp = self.engine_config.mixed_precision or {}
        param_dtype = PrecisionType.to_dtype(mp.get("param_dtype", "bf16"))
        reduce_dtype = PrecisionType.to_dtype(mp.get("reduce_dtype", "fp32"))
        if (param_dtype, reduce_dtype) != (torch.bfloat16, torch.float32):
            raise ValueError(
                f"strategy=vexact computes in bf16 with fp32 gradient reduction (the engine's numerics); got "
                f"mixed_precision param_dtype={param_dtype}, reduce_dtype={reduce_dtype}"
            )
        self._autocast_dtype = param_dtype  # read by nothing here: forward_step runs without autocast
        self.scaler = None
        offload_policy = None
        wants_offload = self.engine_config.offload_policy or self.engine_config.forward_only
        if wants_offload and get_device_name() != "cpu":  # on a CPU platform the parameters already live there
            self._is_offload_param = False
            self._is_offload_optimizer = False
            offload_policy = CPUOffloadPolicy(pin_memory=True)
            self._uses_fsdp2_cpu_offload_policy = True
        fsdp_kwargs = {
            "mesh": self.device_mesh,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
            ),
            "offload_policy": offload_policy,
            "reshard_after_forward": self.engine_config.reshard_after_forward,
        }
        full_state = module.state_dict()
        apply_fsdp2(module, fsdp_kwargs, self.engine_config)
        fsdp2_load_full_state_dict(module, full_state, self.device_mesh, offload_policy)
        # logits/logprobs read the final norm (root) and lm_head (its own FSDP group unless tied to the
        # embedding): both must be unsharded for them as for forward
        for owner in (module, module.lm_head):
            if isinstance(owner, FSDPModule):
                for name in ("logits", "logprobs"):
                    register_fsdp_forward_method(owner, name)
        return module

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        # the backward pass (and gradient checkpointing's recomputation in it) must run on the same kernels as the
        # forward, so the backend is set around verl's whole micro-batch loop, not only around the forward
        with vk.use_backend(self.kernel_backend):
            return super().forward_backward_batch(data, loss_function, forward_only)

    def train_batch(self, data: TensorDict, loss_function):
        # verl's train_mini_batch flags a step's last mini-batch with update_lr_scheduler; a call without the flag
        # (a direct caller) is a step of its own. The attribution runs before the step's first update, so on the
        # weights that scored the step's old_log_prob, and on every data-parallel rank alike (FSDP's collectives)
        first = not self._tim_step_open
        if first:
            self._tim_step += 1
        self._tim_step_open = not tu.get_non_tensor_data(data=data, key="update_lr_scheduler", default=True)
        cfg = self.tim_attribution
        attr = self.tim_attribute(data) if first and cfg.every and self._tim_step % cfg.every == 0 else None
        versions, timing = [], {}
        if first:  # the version check and the timing of the old_log_prob before this step
            versions, self._version_metrics = self._version_metrics, []
            timing, self._infer_timing = self._infer_timing, {}
        outputs = super().train_batch(data, loss_function)
        if self.is_mp_src_rank_with_outputs():
            for m in [attr or {}, timing, *versions]:  # verl's layout: one value per micro-batch
                for k, v in m.items():
                    outputs["metrics"].setdefault(k, []).append(v)
        return outputs

    def infer_batch(self, data: TensorDict, loss_function=None):
        # where verl's old_log_prob goes on this side: the whole call and its forwards (each micro-batch's forward
        # and log-probs, to the end of its kernels), summed until the next training step logs them as
        # vexact/perf/infer_batch_s and vexact/perf/infer_forward_s; the rest of verl's timing_s/old_log_prob
        # is verl's own dispatch and collection
        _sync_device()
        start = time.perf_counter()
        outputs = super().infer_batch(data, loss_function)
        _sync_device()
        t = self._infer_timing
        t["vexact/perf/infer_batch_s"] = t.get("vexact/perf/infer_batch_s", 0.0) + time.perf_counter() - start
        t.setdefault("vexact/perf/infer_forward_s", 0.0)
        t.setdefault("vexact/perf/infer_micro_batches", 0.0)
        if not self.engine_config.forward_only and isinstance(outputs, dict) and "model_output" in outputs:
            metrics = self.check_versions(data, outputs["model_output"]["log_probs"])
            if metrics:
                self._version_metrics.append(metrics)
        return outputs

    def check_versions(self, data: TensorDict, log_probs: torch.Tensor) -> dict:
        """``vexact/behavior/*`` and ``vexact/staleness/*`` of verl's ``old_log_prob`` batch ``data`` (with
        ``rollout_log_probs`` and each response's ``extra_fields["token_global_steps"]``), ``log_probs`` being this
        engine's output for it at the weights it holds; ``{}`` where the batch has no versions or no published version
        is known. Tokens of the held version compare with ``log_probs``; with ``keep_previous_version`` the previous
        version's tokens are rescored with its host copy (on every rank alike: the forward is collective)."""
        current = published_version()
        token_versions = _token_versions(data)
        if current is None or token_versions is None or "rollout_log_probs" not in data.keys():
            return {}
        from verl.workers.utils.padding import response_from_nested

        if self.keep_previous_version:
            if current not in self._held_versions:
                self._held_versions[current] = self._save_weights()
            for v in [v for v in self._held_versions if v < current - 1 or v > current]:
                del self._held_versions[v]
        mask = _nested_rows(data["response_mask"])
        behavior = [lp.float().cpu() for lp in data["rollout_log_probs"].unbind()]
        lengths = [int(m.sum()) if m.all() else -1 for m in mask.unbind()]  # a tool-interleaved response: -1
        pairs = enumerate(zip(token_versions, lengths, strict=True))
        rows = [i for i, (v, n) in pairs if len(v) == n == len(behavior[i])]
        scored = {current: [lp.float().cpu() for lp in response_from_nested(log_probs, mask).unbind()]}
        for version in sorted(v for v in self._held_versions if v != current):
            saved = self._save_weights()
            self._load_weights(self._held_versions[version])
            try:
                out = super().infer_batch(data, None)
            finally:
                self._load_weights(saved)
            scored[version] = [lp.float().cpu() for lp in response_from_nested(out["model_output"]["log_probs"],
                                                                               mask).unbind()]  # fmt: skip
        versions = [token_versions[i] for i in rows]
        metrics = behavior_check([behavior[i] for i in rows], versions, lambda v: [scored[v][i] for i in rows],
                                 held=scored)  # fmt: skip
        metrics.update(staleness_metrics(current, versions))
        metrics["vexact/behavior/responses_unaligned"] = float(len(token_versions) - len(rows))
        return metrics

    def _save_weights(self) -> tuple:
        from verl.utils.fsdp_utils import fsdp2_sharded_save_to_cpu

        state, spec = fsdp2_sharded_save_to_cpu(self.module)
        # `.cpu()` of a CPU shard is the shard itself, which the optimizer would update in place: a copy
        return {k: (t.clone(), s) for k, (t, s) in state.items()}, spec

    def _load_weights(self, saved: tuple) -> None:
        from verl.utils.fsdp_utils import fsdp2_sharded_load_from_cpu

        fsdp2_sharded_load_from_cpu(self.module, *saved)

    def tim_attribute(self, data: TensorDict, specs: list[str] | None = None) -> dict:
        """``tim_attr/<family>/*`` of ``self.tim_attribution.samples`` evenly spaced sequences of ``data`` (verl's
        no-padding batch): their response logprobs on each backend spec (default: each op family on ``fast`` alone,
        then all of them, ``all``) against all-invariant, under ``torch.no_grad``; each spec holds only inside its
        own rescore."""
        input_ids, position_ids = data["input_ids"], data["position_ids"]
        n = len(input_ids.offsets()) - 1
        idx = torch.linspace(0, n - 1, min(self.tim_attribution.samples, n)).round().long().unique().tolist()
        ids = torch.nested.as_nested_tensor([input_ids[i] for i in idx], layout=torch.jagged)
        pos = torch.nested.as_nested_tensor([position_ids[i] for i in idx], layout=torch.jagged)
        temperature = data["temperature"]
        if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
            temperature = temperature.flatten()[idx]
        mask = data["response_mask"]
        mask = (mask.to_padded_tensor(0) if mask.is_nested else mask)[idx]
        sub = TensorDict(
            {k: _rows(data[k], idx).cpu() for k in ("prompts", "responses", "attention_mask") if k in data.keys()},
            batch_size=[len(idx)],
        )
        tu.assign_non_tensor(sub, max_response_len=mask.shape[1])
        device = get_device_id()
        ids, pos = ids.to(device), pos.to(device)
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(device)

        def score(spec: str) -> torch.Tensor:
            lp, _ = packed_log_probs(
                self.module, ids, pos, temperature, backend=spec, chunk_size=self.logprob_chunk_size
            )
            return no_padding_2_padding(lp.cpu(), sub).float()

        with torch.no_grad():
            return attribution_metrics(score, specs or self.tim_attribution.specs(self.module.config), mask)

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        micro_batch = micro_batch.to(get_device_id())
        start = time.perf_counter()
        model_output = self.vexact_model_output(micro_batch)
        if forward_only:  # infer_batch's micro-batches (below, .item() waits for the kernels anyway)
            _sync_device()
            t = self._infer_timing
            t["vexact/perf/infer_forward_s"] = t.get("vexact/perf/infer_forward_s", 0.0) + time.perf_counter() - start
            t["vexact/perf/infer_micro_batches"] = t.get("vexact/perf/infer_micro_batches", 0.0) + 1
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )
        else:
            if not forward_only:
                raise ValueError("a training step (forward_only=False) needs a loss_function")
            loss = torch.tensor(1.0, device=get_device_id())
            metrics = {}
        output = {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
        return loss, output

    def vexact_model_output(self, micro_batch: TensorDict) -> dict:
        """``{"log_probs": nested [B, (L_i)], "entropy": ...}`` of one packed micro-batch, verl's layout."""
        pad_mode = tu.get_non_tensor_data(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
        if pad_mode != DatasetPadMode.NO_PADDING:
            raise NotImplementedError(f"strategy=vexact takes verl's no-padding micro-batches; got {pad_mode}")
        for key in ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only"):
            if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
                raise NotImplementedError(f"strategy=vexact does not implement {key}=True")
        # verl's text batches still carry the key, one empty entry per sample: refuse only real multimodal inputs
        if extract_multi_modal_inputs(micro_batch.get("multi_modal_inputs", [])):
            raise NotImplementedError("strategy=vexact does not take multimodal inputs")
        position_ids = micro_batch["position_ids"]
        if position_ids.dim() == 3:
            raise NotImplementedError("strategy=vexact does not take 3-D (mrope) position_ids")
        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        # verl's own no_grad (inference) or grad (training) context applies; no autocast: bf16 parameters come
        # from FSDP's mixed precision, fp32 is used inside the kernels
        log_probs, entropy = packed_log_probs(
            self.module,
            micro_batch["input_ids"],
            position_ids,
            micro_batch["temperature"],
            with_entropy=calculate_entropy,
            backend=self.kernel_backend,
            chunk_size=self.logprob_chunk_size,
        )
        out = {"log_probs": log_probs}
        if calculate_entropy:
            out["entropy"] = entropy
        return out

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """verl's own checkpoint (per-rank model, optimizer and extra-state shards, HF config and tokenizer, and with
        ``hf_model`` in ``save_contents`` a full Hugging Face checkpoint under ``huggingface/``: the module carries HF
        parameter names, so verl's own HF export applies to its state dict unchanged)."""
        # verl's manager writes `model.config.save_pretrained(...)`, builds the HF class for `hf_model` from that
        # config and asks `model.can_generate()` on rank 0: show it the HF config of the same checkpoint for that call
        # only (the vexact model keeps its own config)
        module = self.module
        own_config = module.config
        hf_config = copy.deepcopy(self.model_config.hf_config)
        # verl sets flash_attention_2 on the config it trains HF models with; the class verl instantiates for
        # `hf_model` only carries weights to save_pretrained, so build it without requiring flash-attn
        hf_config._attn_implementation = "eager"
        module.config, module.can_generate = hf_config, lambda: False
        try:
            super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)
        finally:
            module.config = own_config
            del module.can_generate


def _sync_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _nested_rows(mask: torch.Tensor) -> torch.Tensor:
    """verl's response mask as a jagged nested tensor (verl's trainer sends it nested; a padded ``[B, R]`` one is cut
    after each row's last response token)."""
    if mask.is_nested:
        return mask
    rows = [m[: int(m.nonzero().max()) + 1] if m.any() else m[:0] for m in mask]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _token_versions(data: TensorDict) -> list[list[int]] | None:
    """Each response's per-token policy versions from verl's ``extra_fields``; None where a response has none."""
    if "extra_fields" not in data.keys():
        return None
    fields = data["extra_fields"]
    fields = fields.tolist() if hasattr(fields, "tolist") else list(fields)
    versions = [f.get(TOKEN_VERSIONS) if isinstance(f, dict) else None for f in fields]
    if any(v is None for v in versions):
        return None
    return [[int(x) for x in v] for v in versions]


def _rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    if t.is_nested:
        return torch.nested.as_nested_tensor([t[i] for i in idx], layout=torch.jagged)
    return t[idx]


def _check_supported(model_config, engine_config) -> None:

    if not isinstance(engine_config, FSDPEngineConfig):
        # e.g. model_engine=veomni: VeOmni's engine config describes VeOmni's own parallel plan, which only the
        # VeOmni variant reads; silently ignoring it would train something other than what was configured
        raise NotImplementedError(
            f"strategy=vexact replaces verl's FSDP engine and reads an FSDPEngineConfig; got "
            f"{type(engine_config).__name__}. Use the default model_engine (fsdp) with actor.strategy=vexact, or "
            f"with model_engine=veomni set actor_rollout_ref.{{actor,ref}}.veomni._target_="
            f"vexact_verl.veomni_engine.VexactVeOmniEngineConfig"
        )
    hf_type = model_config.hf_config.model_type
    if hf_type not in vexact_models.MODEL_CLASSES:
        raise NotImplementedError(
            f"strategy=vexact: model_type {hf_type!r} has no vexact-models definition "
            f"(have {sorted(vexact_models.MODEL_CLASSES)})"
        )
    refused = {
        "model.lora_rank": (model_config.lora_rank, 0),
        "model.use_liger": (model_config.use_liger, False),
        "model.use_fused_kernels": (model_config.use_fused_kernels, False),
        "model.enable_activation_offload": (model_config.enable_activation_offload, False),
        "ulysses_sequence_parallel_size": (engine_config.ulysses_sequence_parallel_size, 1),
    }
    qat = getattr(engine_config, "qat", None)
    refused["qat.enable"] = (bool(qat is not None and getattr(qat, "enable", False)), False)
    bad = {k: v for k, (v, ok) in refused.items() if v != ok}
    if bad:
        allowed = {k: ok for k, (v, ok) in refused.items() if k in bad}
        raise NotImplementedError(f"strategy=vexact does not support {bad}; set {allowed}")
