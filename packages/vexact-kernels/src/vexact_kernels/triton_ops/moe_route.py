"""Softmax top-k routing in one Triton program per token (the invariant backend's ``moe_route`` on CUDA).

Invariance: a token's program reads only its own row of router logits; the max, the softmax sum (``tl.sum`` over one
block of ``next_pow2(E)`` lanes, a reduction tree fixed by E alone) and the k rounds of "largest probability, lowest
index among equals" depend on that row only, so the weights and ids never depend on the batch, and the one launch is
the same in a training batch, a prefill chunk and a captured decode step. The renormalised weights divide by the sum
of the k chosen probabilities added in rank order. (The bits differ from the CPU reference's ``exp``; bitwise
equality holds within a device type, as everywhere.)

Backward (the router gradient of training): recomputed with torch ops from the saved logits and ids; deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_t,
    K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + t * stride_t + offs, mask=mask, other=float("-inf")).to(tl.float32)
    ex = tl.where(mask, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = tl.where(mask, ex / tl.sum(ex, axis=0), -1.0)  # lanes past E can never be chosen
    total = 0.0
    for r in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # ties: the lower expert index
        tl.store(ids_ptr + t * K + r, idx.to(tl.int64))
        tl.store(w_ptr + t * K + r, best)
        total += best
        p = tl.where(offs == idx, -1.0, p)
    if NORM:
        for r in tl.static_range(K):
            w = tl.load(w_ptr + t * K + r)
            tl.store(w_ptr + t * K + r, w / total)


def _route_torch(logits: torch.Tensor, ids: torch.Tensor, norm: bool) -> torch.Tensor:
    """The same weights as a differentiable torch expression (for the backward only)."""
    probs = torch.softmax(logits.float(), dim=-1)
    w = probs.gather(1, ids)
    return w / w.sum(dim=-1, keepdim=True) if norm else w


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, norm):
        t, e = logits.shape
        w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
        if t:
            lg = logits if logits.stride(-1) == 1 else logits.contiguous()
            block = triton.next_power_of_2(e)
            _route_kernel[(t,)](
                lg, w, ids, e, lg.stride(0), K=top_k, NORM=norm, BLOCK_E=block, num_warps=4 if block >= 512 else 1
            )
        ctx.save_for_backward(logits, ids)
        ctx.norm = norm
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, grad_w, _grad_ids):
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            lg = logits.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(_route_torch(lg, ids, ctx.norm), lg, grad_w)
        return g.to(logits.dtype), None, None


def triton_moe_route(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _Route.apply(logits, top_k, norm)
