"""vexact-trainer: the VeXact training actor (single process in this release; FSDP2 is applied from outside)."""

from .actor import Actor, ActorConfig, LogprobOutput
from .batch import PackedBatch, pack
from .losses import (
    PPOOutput,
    check_finite_loss,
    grpo_advantages,
    masked_mean,
    mismatch_metrics,
    ppo_clip_loss,
    reinforce_loss,
    rollout_correction,
)

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorConfig",
    "LogprobOutput",
    "PPOOutput",
    "PackedBatch",
    "__version__",
    "check_finite_loss",
    "grpo_advantages",
    "masked_mean",
    "mismatch_metrics",
    "pack",
    "ppo_clip_loss",
    "reinforce_loss",
    "rollout_correction",
]
