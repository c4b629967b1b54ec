"""vexact-trainer: the VeXact training actor (single process in this release; FSDP2 is applied from outside)."""

from .actor import Actor, ActorConfig, LogprobOutput
from .batch import PackedBatch, pack

__version__ = "0.1.0"

__all__ = ["Actor", "ActorConfig", "LogprobOutput", "PackedBatch", "__version__", "pack"]
