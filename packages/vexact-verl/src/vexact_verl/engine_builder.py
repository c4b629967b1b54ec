"""verl's actor engine built in this process, as verl's ``TrainingWorker`` builds it, without Ray or verl's trainer.

For the tests and benchmarks that drive one engine directly: the vexact actor engine (``strategy=vexact``) or verl's
own FSDP2 engine on the same checkpoint, the baseline it is compared with. The caller sets verl's platform and the
process group first (the tests' ``verl_device`` fixture, ``benchmarks/old_log_prob.py``'s ``setup_cpu_verl``) and,
for ``vexact``, registers the engine (:func:`vexact_verl.registration.register_engine`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl.trainer.config import CheckpointConfig
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from vexact_models import default_checkpoint

from .actor_engine import ENGINE_BACKEND, MODEL_TYPE, VexactFSDPEngineConfig

STRATEGIES = (ENGINE_BACKEND, "fsdp2")


def build_actor_engine(
    strategy: str = ENGINE_BACKEND,
    *,
    path: str | Path | None = None,
    family: str | None = None,
    forward_only: bool = False,
    checkpoint_config: CheckpointConfig | None = None,
    **engine_fields: Any,
) -> FSDPEngineWithLMHead:
    """verl's ``language_model`` engine for ``actor.strategy=strategy``, ``initialize()``d (FSDP2 wrapping, optimizer,
    LR scheduler): the actor, or the ref with ``forward_only``.

    ``strategy``: ``vexact`` (:class:`~vexact_verl.actor_engine.VexactEngineWithLMHead`, looked up in verl's
    ``EngineRegistry`` as verl's worker looks it up) or ``fsdp2`` (verl's own ``FSDPEngineWithLMHead``, built by its
    class: verl registers it for ``cuda`` and ``npu`` only, so the registry has none on a CPU platform; its
    transformers model on SDPA attention, since verl's default flash-attention does not run on CPU).
    ``path``: the HF checkpoint, else the committed tiny one of ``family`` (``qwen3`` when neither is given).
    Gradient checkpointing is on unless ``forward_only``, as verl's defaults have it. ``engine_fields``: further
    fields of the engine config (``vexact={...}`` for the vexact engine's own settings, ``use_dynamic_bsz``,
    ``infer_max_token_len_per_gpu``, ``mixed_precision``, ...)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not built here; allowed: {list(STRATEGIES)}")
    if path is not None and family is not None:
        raise ValueError(f"give a checkpoint path or a family, not both: path={str(path)!r}, family={family!r}")
    path = path if path is not None else default_checkpoint(family or "qwen3")
    override = {"attn_implementation": "sdpa"} if strategy == "fsdp2" else {}
    model_config = HFModelConfig(
        path=str(path), enable_gradient_checkpointing=not forward_only, override_config=override
    )
    model_config.model_type = MODEL_TYPE  # what verl's TrainingWorker sets before EngineRegistry.new
    # verl compiles its entropy function by default (inductor: a C++ toolchain and a compilation on CPU); the vexact
    # engine's forward_step never calls it
    engine_fields = {"use_torch_compile": False, **engine_fields}
    config_cls = VexactFSDPEngineConfig if strategy == ENGINE_BACKEND else FSDPEngineConfig
    engine_config = config_cls(forward_only=forward_only, **engine_fields)
    # the config's own check accepts fsdp strategies only and its strategy field is frozen: set it as
    # FSDPActorConfig.__post_init__ copies actor.strategy in
    object.__setattr__(engine_config, "strategy", strategy)
    engine_config.use_remove_padding = model_config.use_remove_padding  # as TrainingWorker copies it
    configs = dict(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=10),
        checkpoint_config=checkpoint_config or CheckpointConfig(),
    )
    if strategy == ENGINE_BACKEND:
        engine = EngineRegistry.new(model_type=MODEL_TYPE, backend=strategy, **configs)
    else:
        engine = FSDPEngineWithLMHead(**configs)
    engine.initialize()
    return engine
