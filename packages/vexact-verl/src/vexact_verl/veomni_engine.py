"""Invariant mode under verl's VeOmni engine (``model_engine=veomni``): the vexact model and kernels, VeOmni's plan.

With ``model_engine=veomni`` verl builds the actor's and the ref's engines from a ``VeOmniEngineConfig``
(``actor.veomni`` / ``ref.veomni``), and the backend is that config's ``strategy``, which verl pins to ``"veomni"``.
One switch per role selects this engine instead, through Hydra's own ``_target_``::

    actor_rollout_ref.actor.veomni._target_=vexact_verl.veomni_engine.VexactVeOmniEngineConfig
    actor_rollout_ref.ref.veomni._target_=vexact_verl.veomni_engine.VexactVeOmniEngineConfig

:class:`VexactVeOmniEngineConfig` is verl's ``VeOmniEngineConfig`` (every field, every default, verl's own checks)
whose ``strategy`` reads ``vexact_veomni``; verl then builds :class:`VexactVeOmniEngineWithLMHead`.

What runs, and why it is this and not VeOmni's own Hugging Face model on our kernels (see the package README):
VeOmni's model is transformers' modeling code with kernel slots (``OpSlot``) for RMSNorm, rotary, SwiGLU and the
loss; its residual adds, dtype casts, rotary tables and the logits -> logprob path are transformers' and verl's,
so routing its matmuls to vexact kernels would still leave reductions whose order we do not own. The rollout's
logprobs can only be reproduced by the same model definition on the same kernels, so this engine runs
``vexact_models`` (the trainer's and the rollout's model) and maps VeOmni's parallel plan onto it:

- VeOmni's plan on a pure data-parallel mesh is FSDP2: one ``fully_shard`` unit per decoder layer
  (``_no_split_modules``) plus the root, ``reshard_after_forward`` on, bf16 parameters with fp32 master weights and
  fp32 gradient reduction (``mixed_precision: true``), optional CPU offload (``enable_fsdp_offload``), HSDP when
  ``fsdp_size`` divides the data-parallel size. The vexact FSDP engine (:class:`vexact_verl.actor_engine.
  VexactEngineWithLMHead`) applies the same plan to the vexact model with verl's FSDP2 helpers; ``fsdp_size``,
  offload, ``forward_prefetch``, micro-batching, seed and determinism settings carry over.
- VeOmni's optimizer and LR scheduler (``veomni.optim.build_optimizer`` / ``build_lr_scheduler``, from verl's
  ``VeOmniOptimizerConfig``) are used as verl's VeOmni engine uses them.
- Refused, by name (they change the reduction order of a row, run a different model, or would be silently
  ignored): Ulysses sequence parallelism, expert parallelism, ``mixed_precision: false`` (pure bf16 training),
  async activation offload, router replay, ``pad_to_length``, reentrant checkpointing, extra ``basic_modules``,
  ``load_checkpoint_path``, and any VeOmni kernel selector (``rms_norm_implementation``, ...) other than its
  default: the vexact model always runs the vexact kernels. ``attn_implementation`` and ``moe_implementation``
  select VeOmni's own attention / MoE kernels and are read by nothing here; ``init_device`` neither (the checkpoint
  is loaded on the host and sharded by verl's ``fsdp2_load_full_state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from verl.workers.config import FSDPEngineConfig, VeOmniEngineConfig, VeOmniOptimizerConfig
from verl.workers.config.engine import EngineConfig

from .actor_engine import VexactEngineWithLMHead, VexactFSDPEngineConfig

VEOMNI_BACKEND = "vexact_veomni"

# VeOmni's kernel selectors for its own model (OpsImplementationConfig): none applies to the vexact model
_KERNEL_SELECTORS = (
    "cross_entropy_loss_implementation",
    "rms_norm_implementation",
    "swiglu_mlp_implementation",
    "rotary_pos_emb_implementation",
    "load_balancing_loss_implementation",
    "rms_norm_gated_implementation",
    "causal_conv1d_implementation",
    "chunk_gated_delta_rule_implementation",
    "dsa_indexer_implementation",
    "dsa_attention_implementation",
    "mhc_implementation",
    "qat_implementation",
)
# copied as they are: verl's shared engine fields (micro-batching, offload, seed, ...) and the FSDP knobs that
# VeOmni's config spells the same way
_SHARED = tuple(f.name for f in fields(EngineConfig) if f.name not in ("_target_", "strategy", "router_replay")) + (
    "fsdp_size",
    "forward_prefetch",
    "entropy_from_logits_with_chunking",
    "entropy_from_logits_chunk_size",
    "entropy_checkpointing",
)


@dataclass
class VexactVeOmniEngineConfig(VeOmniEngineConfig):
    """verl's ``VeOmniEngineConfig`` that selects :class:`VexactVeOmniEngineWithLMHead` (``strategy``
    ``vexact_veomni``). Set it as the ``_target_`` of ``actor_rollout_ref.actor.veomni`` and ``.ref.veomni``. Its
    ``vexact`` section holds the vexact engine's own settings, as
    :class:`vexact_verl.actor_engine.VexactFSDPEngineConfig`'s does
    (``+actor_rollout_ref.actor.veomni.vexact.tim_attribute_every=10``)."""

    vexact: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        # verl's checks (and its attn_implementation renaming) assert the strategy is "veomni": run them as such
        object.__setattr__(self, "strategy", "veomni")
        super().__post_init__()
        object.__setattr__(self, "strategy", VEOMNI_BACKEND)


def veomni_refusals(engine_config: VeOmniEngineConfig) -> dict[str, tuple[object, object]]:
    """``{field: (value, allowed)}`` for each VeOmni setting this engine cannot honour (empty when all can be)."""
    c = engine_config
    checks = {
        "ulysses_parallel_size": (c.ulysses_parallel_size, 1),
        "expert_parallel_size": (c.expert_parallel_size, 1),
        "mixed_precision": (c.mixed_precision, True),
        "enable_async_activation_offload": (c.enable_async_activation_offload, False),
        "router_replay.mode": (c.router_replay.mode, "disabled"),
        "pad_to_length": (c.pad_to_length, False),
        "enable_reentrant": (c.enable_reentrant, False),
        "basic_modules": (list(c.basic_modules or []), []),
        "load_checkpoint_path": (c.load_checkpoint_path, None),
    }
    defaults = {f.name: f.default for f in fields(VeOmniEngineConfig)}
    for name in _KERNEL_SELECTORS:
        checks[name] = (getattr(c, name), defaults[name])
    return {k: (v, ok) for k, (v, ok) in checks.items() if v != ok}


def fsdp_config_from_veomni(engine_config: VeOmniEngineConfig) -> FSDPEngineConfig:
    """The vexact FSDP engine's config for a VeOmni engine config (raises ``NotImplementedError`` naming every
    VeOmni setting that does not map)."""
    bad = veomni_refusals(engine_config)
    if bad:
        got = {k: v for k, (v, _) in bad.items()}
        allowed = {k: ok for k, (_, ok) in bad.items()}
        raise NotImplementedError(
            f"model_engine=veomni with the vexact engine runs VeOmni's FSDP2 data-parallel plan around the vexact "
            f"model and kernels only; unsupported settings {got}; set {allowed}"
        )
    kw = {name: getattr(engine_config, name) for name in _SHARED}
    fsdp = VexactFSDPEngineConfig(
        **kw,
        vexact=dict(getattr(engine_config, "vexact", None) or {}),
        offload_policy=engine_config.enable_fsdp_offload,
        reshard_after_forward=True,  # VeOmni reshards every decoder layer after its forward
        use_torch_compile=False,  # verl's compiled entropy helper; the vexact forward computes its own
    )
    object.__setattr__(fsdp, "strategy", VEOMNI_BACKEND)
    return fsdp


class VexactVeOmniEngineWithLMHead(VexactEngineWithLMHead):
    """The vexact FSDP engine, configured from verl's VeOmni engine config and optimizer config."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        if not isinstance(engine_config, VeOmniEngineConfig):
            raise TypeError(
                f"backend {VEOMNI_BACKEND!r} takes a VeOmniEngineConfig (model_engine=veomni); got "
                f"{type(engine_config).__name__}. With the default model_engine set actor.strategy=vexact instead"
            )
        if not isinstance(optimizer_config, VeOmniOptimizerConfig):
            raise TypeError(
                f"backend {VEOMNI_BACKEND!r} takes verl's VeOmniOptimizerConfig; got {type(optimizer_config).__name__}"
            )
        self.veomni_config = engine_config
        fsdp_config = fsdp_config_from_veomni(engine_config)
        _init_veomni_parallel_state(engine_config)
        super().__init__(model_config, fsdp_config, optimizer_config, checkpoint_config)

    def _build_optimizer(self, module):
        from veomni.optim import build_optimizer

        o = self.optimizer_config
        return build_optimizer(module, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, optimizer_type=o.optimizer)

    def _build_lr_scheduler(self, optimizer):
        from veomni.optim import build_lr_scheduler

        o = self.optimizer_config
        return build_lr_scheduler(
            optimizer,
            train_steps=o.total_training_steps,
            lr=o.lr,
            lr_min=o.lr_min,
            lr_decay_style=o.lr_scheduler_type,
            lr_decay_ratio=o.lr_decay_ratio,
            lr_warmup_ratio=o.lr_warmup_steps_ratio,
            lr_start=o.lr_start,
        )


def _init_veomni_parallel_state(engine_config: VeOmniEngineConfig) -> None:
    """VeOmni's process-wide parallel state, as verl's VeOmni engine sets it (VeOmni's optimizer reads it): the same
    data-parallel split (HSDP when ``fsdp_size`` divides the data-parallel size) that verl's FSDP mesh gets here."""
    import torch.distributed as dist

    try:
        from veomni.distributed import parallel_state
    except ImportError as e:
        raise ImportError(
            "model_engine=veomni with the vexact engine needs veomni: "
            "pip install --no-deps -r requirements/veomni.txt (see packages/vexact-verl/README.md)"
        ) from e
    dp_size = dist.get_world_size()  # ulysses_parallel_size is 1 here (refused otherwise)
    fsdp_size = engine_config.fsdp_size
    shard = dp_size if fsdp_size < 0 or fsdp_size >= dp_size else fsdp_size
    if dp_size % shard:
        raise ValueError(f"fsdp_size={fsdp_size} must divide the data-parallel size {dp_size}")
    parallel_state.init_parallel_state(
        dp_size=dp_size,
        dp_replicate_size=dp_size // shard,
        dp_shard_size=shard,
        extra_parallel_sizes=(1,),
        ulysses_size=1,
        dp_mode="fsdp2",
    )
