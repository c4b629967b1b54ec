from __future__ import annotations

from dataclasses import dataclass

import vexact_kernels as vk


@dataclass
class EngineConfig:
    """Engine settings; validated at construction.

    ``num_kv_blocks`` pages of ``block_size`` tokens make the KV cache (default: ``kv_cache_bytes`` worth).
    ``max_num_batched_tokens`` is the token budget of one step (decode tokens plus prefill chunks).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 256 << 20
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    backend: str = "invariant"
    dtype: str | None = None
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backend not in vk.BACKENDS:
            raise ValueError(f"backend must be one of {vk.BACKENDS}, got {self.backend!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"EngineConfig.num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
                " so every running sequence can decode each step"
            )
