"""vexact-engine: the VeXact rollout engine (continuous batching, paged KV, chunked prefill, exact logprobs)."""

from .ablation import MismatchInjection
from .config import EngineConfig
from .expert_parallel import ExpertParallelLLM
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .pipeline import PipelineLLM
from .sampling_params import SamplingParams

__version__ = "0.4.1"

__all__ = [
    "LLM",
    "EngineConfig",
    "LLMEngine",
    "MismatchInjection",
    "ExpertParallelLLM",
    "PipelineLLM",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
