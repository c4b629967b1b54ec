"""vexact-trainer: the VeXact training actor and its FSDP2 trainer (parallelism applied from outside the model)."""

from .actor import Actor, ActorConfig, LogprobOutput
from .batch import PackedBatch, check_temperatures, pack
from .losses import (
    PPOOutput,
    check_finite_loss,
    grpo_advantages,
    k3_kl,
    masked_mean,
    mismatch_metrics,
    ppo_clip_loss,
    reinforce_loss,
    rollout_correction,
    sequence_load_balancing_loss,
)
from .parallel import init_distributed, parallelize
from .tim import (
    BadRolloutError,
    Rescored,
    Rollout,
    compare,
    load_rollouts,
    rescore,
    rollouts_from_outputs,
    rollouts_to_jsonl,
    tim_metrics,
    tim_token_metrics,
    write_report,
)
from .trainer import RolloutBatch, StepMetrics, Trainer, TrainerConfig
from .weights import (
    hf_name,
    iter_weight_buckets,
    iter_weights,
    save_hf_checkpoint,
    sync_weights,
    sync_weights_broadcast,
)

__version__ = "0.3.1"

__all__ = [
    "Actor",
    "BadRolloutError",
    "ActorConfig",
    "LogprobOutput",
    "PPOOutput",
    "PackedBatch",
    "Rescored",
    "Rollout",
    "RolloutBatch",
    "StepMetrics",
    "Trainer",
    "TrainerConfig",
    "__version__",
    "check_finite_loss",
    "compare",
    "check_temperatures",
    "grpo_advantages",
    "hf_name",
    "init_distributed",
    "iter_weight_buckets",
    "iter_weights",
    "k3_kl",
    "load_rollouts",
    "masked_mean",
    "mismatch_metrics",
    "pack",
    "parallelize",
    "ppo_clip_loss",
    "reinforce_loss",
    "rescore",
    "rollout_correction",
    "rollouts_from_outputs",
    "rollouts_to_jsonl",
    "save_hf_checkpoint",
    "sequence_load_balancing_loss",
    "sync_weights",
    "sync_weights_broadcast",
    "tim_metrics",
    "tim_token_metrics",
    "write_report",
]
