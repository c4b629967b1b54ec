"""Fixed-order reductions for the CPU reference path.

torch's CPU reductions (sum, mean, mm, SDPA) pick their blocking and vector/tail split from the shape of the whole
tensor, so a row's result can change with the number of rows next to it. Here every reduction is a chain of
elementwise IEEE adds whose order depends only on the length being reduced: a pairwise tree inside blocks of a
fixed width, and the block results added left to right. Elementwise add/mul are correctly rounded whatever the
vectorisation, so the result of a row is a function of that row alone.
"""

from __future__ import annotations

import torch


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pairwise-tree sum over ``dim`` (zero-padded to a power of two); the dimension is removed."""
    dim = dim % x.dim()
    n = x.shape[dim]
    p = _next_pow2(n)
    if p != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = p - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while x.shape[dim] > 1:
        h = x.shape[dim] // 2
        x = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
    return x.squeeze(dim)


def blocked_sum(x: torch.Tensor, block: int, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` in blocks of ``block``: a tree inside each block, blocks accumulated in order."""
    dim = dim % x.dim()
    n = x.shape[dim]
    acc = None
    for start in range(0, n, block):
        part = tree_sum(x.narrow(dim, start, min(block, n - start)), dim)
        acc = part if acc is None else acc + part
    return acc


def inclusive_scan(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum over the last dim by Hillis-Steele doubling: a fixed add pattern per position."""
    n = x.shape[-1]
    shift = 1
    while shift < n:
        x = torch.cat([x[..., :shift], x[..., shift:] + x[..., :-shift]], dim=-1)
        shift *= 2
    return x


def renormalized_topk(w: torch.Tensor, norm_topk_prob: bool, routed_scaling_factor: float) -> torch.Tensor:
    """DeepSeek's routing weights from each row's chosen scores ``w [T, k]``: with ``norm_topk_prob``, divided by
    their sum taken in rank order (``+ 1e-20`` as transformers), then times ``routed_scaling_factor``. A torch
    expression (differentiable), the same ops in the same order wherever it is called."""
    if norm_topk_prob:
        total = w[:, 0]
        for r in range(1, w.shape[1]):
            total = total + w[:, r]
        w = w / (total + 1e-20).unsqueeze(-1)
    return w * routed_scaling_factor
