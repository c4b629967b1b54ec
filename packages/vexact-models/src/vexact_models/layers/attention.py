from __future__ import annotations

import torch
from torch import nn

import vexact_kernels as vk

from ..attention_metadata import AttentionMetadata


class Attention(nn.Module):
    """Attention core over already-projected q/k/v; packed or paged according to the metadata.

    In the paged layout the new tokens' K/V are first written to this layer's cache, then every new query reads its
    keys from the cache, so a prefill chunk and a decode step see keys through the same path.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None, window: int | None = None
    ):
        """``scale``: the softmax scale (default ``head_dim ** -0.5``), passed to the kernel in both layouts;
        ``window``: this layer's sliding window (keys at positions ``> p - window``; None: every earlier key)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        sinks: torch.Tensor | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """``sinks [Hq]``: the layer's attention-sink logits (gpt-oss), None for none. ``kv_written``: the caller has
        stored this step's k and v in the paged cache already (``vk.rms_norm_rotary_qk(kv_write=...)``)."""
        extra = {}
        if self.window is not None or sinks is not None:  # the plain call otherwise, as every other family makes it
            extra = dict(window=self.window, sinks=sinks)
        if not meta.paged:
            return vk.attention_packed(q, k, v, meta.cu_seqlens, self.scale, **extra)
        if kv_cache is None:
            raise ValueError("paged attention metadata given but no KV cache for this layer")
        k_cache, v_cache = kv_cache
        if not kv_written:
            vk.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        paged = (q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.cu_seqlens)
        # built by the step's first layer, then shared: the same for every layer of the same shapes
        key = ("attention_paged", q.shape, k_cache.shape, v_cache.shape, q.device, vk.get_backend("attention"))
        layout = meta.per_step(key, lambda: vk.paged_attention_layout(*paged))
        if layout is None:  # nothing derived up front on this path (CPU, fast)
            return vk.attention_paged(*paged, self.scale, **extra)
        return vk.attention_paged(*paged, self.scale, layout=layout, **extra)
