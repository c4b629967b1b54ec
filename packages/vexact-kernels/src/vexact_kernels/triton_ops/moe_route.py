"""Top-k routing in one Triton program per token: the invariant backend's ``moe_route`` (softmax) and
``moe_route_grouped`` (DeepSeek-V3, below) on CUDA.

Invariance (design.md rule 5): a token's program reads only its own row of router logits; the max, the softmax sum
(``tl.sum`` over one block of ``next_pow2(E)`` lanes, a reduction tree fixed by E alone) and the k rounds of "largest
probability, lowest index among equals" depend on that row only, so the weights and ids never depend on the batch, and
the one launch is the same in a training batch, a prefill chunk and a captured decode step. The renormalised weights
divide by the sum of the k chosen probabilities added in rank order. (The bits differ from the CPU reference's ``exp``;
bitwise equality holds within a device type, as everywhere.)

Backward (the router gradient of training): recomputed with torch ops from the saved logits and ids; deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._reduce import renormalized_topk
from . import next_pow2


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


def _logits_grad(route_torch, ctx, grad_w: torch.Tensor, *args) -> torch.Tensor:
    """The router logits' gradient: ``grad_w`` through ``route_torch(logits, ids, *args)``, the routing weights as a
    differentiable torch expression, at the logits and ids the forward saved."""
    logits, ids = ctx.saved_tensors
    with torch.enable_grad():
        lg = logits.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(route_torch(lg, ids, *args), lg, grad_w)
    return g.to(logits.dtype)


class _KernelRoute(torch.autograd.Function):
    """Routing by a kernel, differentiated through torch ops: the forward runs ``route(logits)`` (a launch: weights
    ``[T, k]`` fp32 and ids ``[T, k]``); the backward is :func:`_logits_grad` through ``route_torch(logits, ids,
    *args)``, the same weights as a differentiable torch expression. The ids take no gradient."""

    @staticmethod
    def forward(ctx, logits, route, route_torch, args):
        w, ids = route(logits)
        ctx.save_for_backward(logits, ids)
        ctx.route_torch, ctx.args = route_torch, args
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, grad_w, _grad_ids):
        return _logits_grad(ctx.route_torch, ctx, grad_w, *ctx.args), None, None, None


def _route_torch(logits: torch.Tensor, ids: torch.Tensor, norm: bool) -> torch.Tensor:
    """The same weights as a differentiable torch expression (for the backward only)."""
    probs = torch.softmax(logits.float(), dim=-1)
    w = probs.gather(1, ids)
    return w / w.sum(dim=-1, keepdim=True) if norm else w


def _launch_per_token(logits: torch.Tensor, top_k: int, launch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [T, k] fp32, ids [T, k])`` filled by ``launch(logits_rows, w, ids, E, BLOCK_E, num_warps)``, a program
    per token over its row of ``next_pow2(E)`` lanes (no launch for no token)."""
    t, e = logits.shape
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        block = next_pow2(e)
        launch(logits if logits.stride(-1) == 1 else logits.contiguous(), w, ids, e, block, 4 if block >= 512 else 1)
    return w, ids


def triton_moe_route(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    def launch(lg, w, ids, e, block, warps):
        _route_kernel[(lg.shape[0],)](lg, w, ids, e, lg.stride(0), K=top_k, NORM=norm, BLOCK_E=block, num_warps=warps)

    return _KernelRoute.apply(logits, lambda lg: _launch_per_token(lg, top_k, launch), _route_torch, (norm,))


# gpt-oss's routing (``moe_route(topk_before_softmax=True)``): the top-k of the logits, then a softmax over those k.
# On CUDA the invariant backend computes it with torch ops (``moe._route_topk_softmax``: a stable descending sort,
# a gather, the max, ``exp``, the k terms added in rank order, one division), about ten launches a layer. This kernel
# does the same steps in one program per token and is meant to give the same bits: the k rounds of "largest logit,
# lowest index among equals" are the stable sort's first k, the max is exact, ``exp`` is libdevice's ``expf`` (what
# torch's CUDA ``exp`` runs for fp32), the sum is in rank order and the division is IEEE (``div_rn``). Under the
# interpreter ``exp`` is numpy's. Used where ``moe.ROUTE_TOPK_FIRST_KERNEL`` is on; the GPU test compares it with the
# torch ops bit for bit.


@triton.jit
def _route_topk_first_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_t,
    K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    taken = offs >= E  # padding lanes are never chosen
    ranks = tl.arange(0, BLOCK_K)
    top = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for r in tl.static_range(K):
        free = ~taken
        nan = free & (x != x)  # torch's descending sort puts NaN first
        cand = tl.where(free & (x == x), x, float("-inf"))
        best = tl.max(cand, axis=0)
        idx = tl.min(tl.where(free & (cand == best), offs, BLOCK_E), axis=0)
        idx = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, tl.min(tl.where(nan, offs, BLOCK_E), axis=0), idx)
        hit = offs == idx
        top = tl.where(ranks == r, tl.max(tl.where(hit, x, float("-inf")), axis=0), top)  # the logit, its sign of 0
        ids = tl.where(ranks == r, idx.to(tl.int64), ids)
        taken = taken | hit
    d = top - tl.max(tl.where(ranks < K, top, float("-inf")), axis=0)
    if INTERPRET:
        e = tl.exp(d)
    else:
        e = libdevice.exp(d)
    total = tl.max(tl.where(ranks == 0, e, float("-inf")), axis=0)
    for r in tl.static_range(1, K):
        total = total + tl.max(tl.where(ranks == r, e, float("-inf")), axis=0)
    tl.store(w_ptr + t * K + ranks, tl.div_rn(e, total), mask=ranks < K)
    tl.store(ids_ptr + t * K + ranks, ids, mask=ranks < K)


def triton_moe_route_topk_first(logits: torch.Tensor, top_k: int, route_torch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] fp32, ids [T, k])``; ``route_torch(logits, ids)``: the weights as the torch expression the
    backward differentiates (the torch path's own, so the router gradient is that path's)."""
    from . import interpreting

    def launch(lg, w, ids, e, block, warps):
        _route_topk_first_kernel[(lg.shape[0],)](
            lg, w, ids, e, lg.stride(0), K=top_k, BLOCK_E=block, BLOCK_K=next_pow2(top_k),
            INTERPRET=interpreting(), num_warps=warps,
        )  # fmt: skip

    return _KernelRoute.apply(logits, lambda lg: _launch_per_token(lg, top_k, launch), route_torch, ())


# DeepSeek-V3 grouped routing (``moe_route_grouped``): one program per token over its row seen as
# [n_group, E / n_group] (both padded to powers of two). Every step reads that row only: the scores (sigmoid as
# ``1 / (1 + exp(-x))``; softmax as above), each group's two largest choice scores added (larger + smaller), the
# ``topk_group`` rounds of "best group, lowest index among equals", then k rounds of "best masked choice score, lowest
# expert index among equals", the k unbiased scores added in rank order. Index keys of padded lanes lie past E, so a
# tie at -inf can never pick one.


@triton.jit
def _grouped_route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_t, scale,
    K: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    s = tl.arange(0, BLOCK_S)
    valid = (g[:, None] < N_GROUP) & (s[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + s[None, :]  # [BLOCK_G, BLOCK_S]
    key = tl.where(valid, expert, BLOCK_G * BLOCK_S)
    x = tl.load(logits_ptr + t * stride_t + expert, mask=valid, other=0.0).to(tl.float32)
    if SOFTMAX:
        x = tl.where(valid, x, float("-inf"))
        ex = tl.where(valid, tl.exp(x - tl.max(tl.max(x, axis=1), axis=0)), 0.0)
        scores = ex / tl.sum(tl.sum(ex, axis=1), axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if TOPK_GROUP < N_GROUP:
        top1 = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == top1[:, None], s[None, :], BLOCK_S), axis=1)
        top2 = tl.max(tl.where(s[None, :] == first[:, None], float("-inf"), choice), axis=1)
        group_score = top1 + top2
        group_key = tl.where(g < N_GROUP, g, BLOCK_G)
        kept = tl.zeros([BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            cand = tl.where(kept == 0, group_score, float("-inf"))
            best = tl.max(cand, axis=0)
            gi = tl.min(tl.where((cand == best) & (kept == 0), group_key, BLOCK_G), axis=0)
            kept = tl.where(g == gi, 1, kept)
        choice = tl.where(kept[:, None] == 1, choice, float("-inf"))
    ranks = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    taken = tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.int32)
    total = 0.0
    for r in tl.static_range(K):
        cand = tl.where(taken == 0, choice, float("-inf"))
        best = tl.max(tl.max(cand, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where((cand == best) & (taken == 0), key, BLOCK_G * BLOCK_S), axis=1), axis=0)
        hit = key == idx
        score = tl.max(tl.max(tl.where(hit, scores, float("-inf")), axis=1), axis=0)
        taken = tl.where(hit, 1, taken)
        w = tl.where(ranks == r, score, w)
        ids = tl.where(ranks == r, idx.to(tl.int64), ids)
        total += score
    if NORM:
        w = w / (total + 1e-20)
    w = w * scale
    tl.store(w_ptr + t * K + ranks, w, mask=ranks < K)
    tl.store(ids_ptr + t * K + ranks, ids, mask=ranks < K)


def _grouped_route_torch(logits, ids, norm, scale, scoring_func) -> torch.Tensor:
    """The same weights as a differentiable torch expression (for the backward only)."""
    x = logits.float()
    scores = torch.sigmoid(x) if scoring_func == "sigmoid" else torch.softmax(x, dim=-1)
    return renormalized_topk(scores.gather(1, ids), norm, scale)


def triton_moe_route_grouped(
    logits, top_k, bias, n_group, topk_group, norm, scale, scoring_func
) -> tuple[torch.Tensor, torch.Tensor]:
    def route(logits):
        t, e = logits.shape
        w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
        if t:
            lg = logits if logits.stride(-1) == 1 else logits.contiguous()
            b = lg if bias is None else bias.contiguous()
            group_size = e // n_group
            block_g, block_s = next_pow2(n_group), next_pow2(group_size)
            _grouped_route_kernel[(t,)](
                lg, b, w, ids, lg.stride(0), scale,
                K=top_k, N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group, NORM=norm,
                SOFTMAX=scoring_func == "softmax", HAS_BIAS=bias is not None,
                BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=next_pow2(top_k),
                num_warps=4 if block_g * block_s >= 512 else 1,
            )  # fmt: skip
        return w, ids

    # the bias (a buffer of the checkpoint's, not trained) takes no gradient, as before
    return _KernelRoute.apply(logits, route, _grouped_route_torch, (norm, scale, scoring_func))
