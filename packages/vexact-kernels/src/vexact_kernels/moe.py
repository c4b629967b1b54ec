"""Mixture of experts: top-k routing (:func:`moe_route`, softmax; :func:`moe_route_grouped`, DeepSeek-V3's sigmoid
scores with a selection bias and group-limited top-k) and the fused expert MLP (:func:`fused_moe`).

Layout (transformers' own, in memory): ``w_gate_up [E, 2I, H]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``) and
``w_down [E, H, I]``; a token ``t`` goes through experts ``topk_ids[t, 0..k-1]`` with weights ``topk_weights[t]``.

Invariance (``invariant`` backend): a token's output is a function of its own hidden row, its expert ids and weights
and the expert weights, never of how many tokens its experts received, which other tokens share the batch, the
chunking, or whether a training batch, a prefill chunk or a decode step ran it:

* routing: softmax over the experts in fp32 (max, ``exp``, a fixed-order sum over E); top-k by a stable descending
  sort (on CUDA: one Triton program per token, ``triton_ops/moe_route.py``, k rounds of arg-max), so ties go to the
  lower expert index; renormalisation sums the k weights in rank order;
* grouped routing: sigmoid as ``1 / (1 + exp(-x))``, a group's score the sum of its two largest choice scores,
  groups and experts chosen by stable descending sorts (ties: the lower index), the k unbiased scores added in
  rank order;
* experts: each (token, rank) pair is one row of a grouped GEMM over the pairs sorted (stably) by expert. A row is
  reduced over K in a fixed order that depends on K alone (the CPU reference: ``linear``'s blocks of
  ``LINEAR_BLOCK_K``; the Triton kernel: ``matmul``'s ``BLOCK_K`` tiles in K order), never shared with another row;
  gate/up are cast to the activation dtype, silu-and-mul runs in fp32 and is cast once, down stays fp32;
* combine: ``out[t] = ((0 + w_0 * y_0) + w_1 * y_1) + ...`` in fp32 in the token's own top-k rank order, cast once.

The ``fast`` backend is the mismatch baseline, as transformers runs it: bf16 router logits, ``torch.topk``; the
experts as transformers' ``grouped_mm`` experts implementation runs them on a GPU: the (token, rank) pairs grouped by
expert on the device (groups padded to ``_GROUP_ALIGN`` rows), one ``torch._grouped_mm`` per projection, the weighted
outputs summed in fp32, with no host sync, so a CUDA graph captures it (where ``torch._grouped_mm`` takes the dtype
and device: bf16 on compute capability 9.0+); elsewhere one ``F.linear`` per expert hit, the weighted outputs added
with ``index_add_`` in expert order (transformers' eager loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import portable_math as pm
from ._backend import check_float, get_backend, invariant_device_check
from ._ranges import record_range, tensor_range
from ._reduce import renormalized_topk
from .activation import clamped_swiglu, clamped_swiglu_torch, silu_and_mul
from .linear import _linear_reference
from .triton_ops import use_triton


def _check_route_args(router_logits: torch.Tensor, top_k: int) -> None:
    check_float("moe_route", "router_logits", router_logits)
    if router_logits.dim() != 2:
        raise ValueError(f"moe_route: router_logits must be [T, E]; got {tuple(router_logits.shape)}")
    e = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"moe_route: top_k must be in [1, num_experts={e}]; got {top_k!r}")


def _top_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]``: each row's k largest scores' indices, largest first, ties to the lower index (a stable descending
    sort, so the same ids whatever rows share the batch)."""
    return torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :k]


def moe_route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True, *, topk_before_softmax: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: ``(topk_weights [T, k] fp32, topk_ids [T, k] int64)`` from ``router_logits [T, E]``.

    Ranks are ordered by probability, ties by the lower expert index. Differentiable in ``router_logits`` (the
    router gradient of training flows through the weights; the choice itself has none).

    ``topk_before_softmax`` (gpt-oss): the top-k of the logits themselves (a stable descending sort: ties to the
    lower index), then a softmax over those k (max, exp, a fixed-order sum over the k); ``norm_topk_prob`` is moot
    (the k weights already sum to one). Default off, which leaves the result as without it. On CUDA tensors the
    invariant backend runs the same steps in torch ops whose per-row result depends on the row alone (a stable sort,
    a gather, an exact max, ``exp``, the sum over the k in rank order, one division).
    """
    _check_route_args(router_logits, top_k)
    if topk_before_softmax:
        return _route_topk_softmax(router_logits, top_k)
    if get_backend("moe") == "fast":
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return _routed(w, ids, router_logits)
    if use_triton(router_logits):
        from .triton_ops.moe_route import triton_moe_route

        return _routed(*triton_moe_route(router_logits, top_k, norm_topk_prob), router_logits)
    invariant_device_check("moe_route", router_logits)
    probs = pm.softmax(router_logits.float())
    ids = _top_ids(probs, top_k)
    w = probs.gather(1, ids)
    if norm_topk_prob:
        total = w[:, 0]
        for r in range(1, top_k):
            total = total + w[:, r]
        w = w / total.unsqueeze(-1)
    return _routed(w, ids, router_logits)


# gpt-oss's routing on CUDA in one Triton program per token (``triton_ops.moe_route._route_topk_first_kernel``)
# instead of the torch ops below (about ten launches a layer). The same bits as those ops: on an H200 the GPU test
# ``test_gpu_route_topk_first_kernel_gives_the_torch_ops_bits`` passes and the gpt_oss golden fixture is recorded with
# the same tensors with the kernel on and off. False: the torch ops (for an A/B).
ROUTE_TOPK_FIRST_KERNEL = True


def _topk_softmax_weights(router_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The weights of the chosen ``ids [T, k]``: a softmax over their logits (the max, ``exp``, the k terms added in
    rank order, one division), differentiable in ``router_logits``."""
    top = router_logits.float().gather(1, ids)
    e = torch.exp(top - top.detach().amax(dim=-1, keepdim=True))
    total = e[:, 0]
    for r in range(1, ids.shape[1]):  # rank order, whatever the batch
        total = total + e[:, r]
    return e / total.unsqueeze(-1)


def _route_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if get_backend("moe") == "fast":  # transformers' GptOssTopKRouter: torch.topk, softmax in the logits' dtype
        top, ids = torch.topk(router_logits, top_k, dim=-1)
        return _routed(F.softmax(top, dim=1, dtype=top.dtype).float(), ids, router_logits)
    if router_logits.is_cuda:
        if ROUTE_TOPK_FIRST_KERNEL and use_triton(router_logits):
            from .triton_ops.moe_route import triton_moe_route_topk_first

            w, ids = triton_moe_route_topk_first(router_logits, top_k, _topk_softmax_weights)
            return _routed(w, ids, router_logits)
        ids = _top_ids(router_logits.float(), top_k)
        return _routed(_topk_softmax_weights(router_logits, ids), ids, router_logits)
    invariant_device_check("moe_route", router_logits)
    logits = router_logits.float()
    ids = _top_ids(logits, top_k)
    return _routed(pm.softmax(logits.gather(1, ids)), ids, router_logits)


def _routed(w: torch.Tensor, ids: torch.Tensor, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's result, its ids noted as in ``[0, E)`` (a top-k over E scores), so ``fused_moe``'s check of them
    reads nothing from the device (``_ranges.py``)."""
    record_range(ids, 0, router_logits.shape[-1] - 1)
    return w, ids


SCORING_FUNCS = ("sigmoid", "softmax")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_grouped_args(
    router_logits, top_k, bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor, scoring_func
) -> None:
    op = "moe_route_grouped"
    check_float(op, "router_logits", router_logits)
    if router_logits.dim() != 2:
        raise ValueError(f"{op}: router_logits must be [T, E]; got {tuple(router_logits.shape)}")
    e = router_logits.shape[1]
    if not _is_int(n_group) or n_group < 1 or e % n_group:
        raise ValueError(f"{op}: n_group must be an int >= 1 that divides num_experts={e}; got {n_group!r}")
    if not _is_int(topk_group) or not 1 <= topk_group <= n_group:
        raise ValueError(f"{op}: topk_group must be an int in [1, n_group={n_group}]; got {topk_group!r}")
    if topk_group < n_group and e // n_group < 2:
        raise ValueError(f"{op}: a group's score is its top-2 sum, so groups need >= 2 experts; got {e // n_group}")
    kept = topk_group * (e // n_group)
    if not _is_int(top_k) or not 1 <= top_k <= kept:
        raise ValueError(
            f"{op}: top_k must be an int in [1, topk_group * num_experts / n_group = {kept}]; got {top_k!r}"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32 or tuple(bias.shape) != (e,):
            what = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise TypeError(f"{op}: bias must be a float32 tensor of shape ({e},) or None; got {what}")
        if bias.device != router_logits.device:
            raise ValueError(f"{op}: bias is on {bias.device} but router_logits on {router_logits.device}")
    if not isinstance(norm_topk_prob, bool):
        raise TypeError(f"{op}: norm_topk_prob must be a bool; got {norm_topk_prob!r}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, int | float):
        raise TypeError(f"{op}: routed_scaling_factor must be a float; got {routed_scaling_factor!r}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"{op}: scoring_func must be one of {SCORING_FUNCS}; got {scoring_func!r}")


class _Sigmoid(torch.autograd.Function):
    """``1 / (1 + exp(-x))``: exp and an IEEE division, whose bits never depend on a value's position in the tensor
    (torch's own CPU sigmoid may differ between its vector body and scalar tail). The backward is ``g * s * (1 - s)``
    from the output, which stays finite where autograd through ``exp(-x)`` would give ``inf * 0``."""

    @staticmethod
    def forward(ctx, x):
        s = pm.sigmoid(x)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g * s * (1.0 - s)


def _grouped_scores(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    x = router_logits.float()
    if scoring_func == "sigmoid":
        return _Sigmoid.apply(x)
    return pm.softmax(x)


def _grouped_weights(scores, ids, norm_topk_prob: bool, routed_scaling_factor: float) -> torch.Tensor:
    """The chosen experts' unbiased scores, renormalised in rank order (``+ 1e-20`` as transformers), scaled."""
    return renormalized_topk(scores.gather(1, ids), norm_topk_prob, routed_scaling_factor)


def _grouped_route_fast(router_logits, top_k, bias, n_group, topk_group, norm, scale, scoring_func):
    """transformers' DeepseekV3 router in plain torch ops (``torch.topk``), ranks sorted: the mismatch baseline."""
    if scoring_func == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        scores = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    choice = scores if bias is None else scores + bias
    t, e = choice.shape
    if topk_group < n_group:
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        choice = choice.masked_fill(~group_mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, ids


def moe_route_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: ``(topk_weights [T, k] fp32, topk_ids [T, k] int64)`` from ``router_logits [T, E]``.

    transformers' ``DeepseekV3MoE.route_tokens_to_experts``, with every order fixed: ``scores = sigmoid(logits)``
    (fp32; ``"softmax"`` as :func:`moe_route`); ``choice = scores + bias`` (``bias [E]`` fp32, the
    ``e_score_correction_bias``, for the selection only); the E experts in ``n_group`` groups of ``E / n_group``, a
    group's score the sum of its two largest choice scores (larger + smaller); the ``topk_group`` best groups kept
    (ties: the lower group index), the others' experts masked to ``-inf``; the ``top_k`` best masked choice scores
    (ties: the lower expert index), ranks ordered by that choice score. The weights are the chosen experts' UNBIASED
    scores, divided (``norm_topk_prob``) by their sum in rank order ``+ 1e-20``, times ``routed_scaling_factor``.
    A token's result depends on its own row only. Differentiable in ``router_logits`` through the weights.
    """
    _check_grouped_args(
        router_logits, top_k, bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor, scoring_func
    )
    args = (router_logits, top_k, bias, n_group, topk_group, norm_topk_prob, float(routed_scaling_factor))
    if get_backend("moe") == "fast":
        return _routed(*_grouped_route_fast(*args, scoring_func), router_logits)
    if use_triton(router_logits):
        from .triton_ops.moe_route import triton_moe_route_grouped

        return _routed(*triton_moe_route_grouped(*args, scoring_func), router_logits)
    invariant_device_check("moe_route_grouped", router_logits)
    scores = _grouped_scores(router_logits, scoring_func)
    choice = scores.detach() if bias is None else scores.detach() + bias
    t, e = choice.shape
    if topk_group < n_group:
        grouped = choice.view(t, n_group, e // n_group)
        top2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values
        group_scores = top2[..., 0] + top2[..., 1]
        keep = _top_ids(group_scores, topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = _top_ids(choice, top_k)
    return _routed(_grouped_weights(scores, ids, norm_topk_prob, float(routed_scaling_factor)), ids, router_logits)


ACTIVATIONS = ("silu", "clamped_swiglu")


def _check_moe_extras(x, w_gate_up, w_down, b_gate_up, b_down, activation) -> None:
    e, two_i, h = w_gate_up.shape
    for name, b, shape in (("b_gate_up", b_gate_up, (e, two_i)), ("b_down", b_down, (e, h))):
        if b is None:
            continue
        check_float("fused_moe", name, b)
        if tuple(b.shape) != shape:
            raise ValueError(f"fused_moe: {name} must be {list(shape)}; got {tuple(b.shape)}")
        if b.device != x.device:
            raise ValueError(f"fused_moe: {name} is on {b.device} but x on {x.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {ACTIVATIONS}; got {activation!r}")


def _check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    check_float("fused_moe", "x", x)
    check_float("fused_moe", "w_gate_up", w_gate_up)
    check_float("fused_moe", "w_down", w_down)
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"fused_moe: expected x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}"
        )
    e, two_i, h = w_gate_up.shape
    if two_i % 2 or h != x.shape[1] or tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"fused_moe: shapes do not agree: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)} (expected "
            f"[E, 2I, {x.shape[1]}]), w_down {tuple(w_down.shape)} (expected [{e}, {h}, {two_i // 2}])"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T={x.shape[0]}, k]"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"fused_moe: topk_ids must be int32 or int64; got {topk_ids.dtype}")
    ids = tensor_range(topk_ids)  # known without a read for the routers' own ids; skipped in a CUDA graph capture
    if ids is not None and (ids[0] < 0 or ids[1] >= e):
        raise ValueError(f"fused_moe: expert ids must be in [0, {e}); got {ids[0]}..{ids[1]}")
    if x.dtype != w_gate_up.dtype or x.dtype != w_down.dtype:
        raise TypeError(
            f"fused_moe: x is {x.dtype} but the expert weights are {w_gate_up.dtype} / {w_down.dtype}; cast them first"
        )


_GROUP_ALIGN = 16  # rows per expert group in the fast grouped path are padded to a multiple of this (as torchtitan)


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether the fast backend runs the experts with ``torch._grouped_mm``: bf16 on a CUDA device of compute
    capability 9.0+ (its CUTLASS kernel); everything else takes the per-expert loop."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def _fused_moe_fast_grouped(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """The experts as one grouped GEMM per projection over the pairs grouped by expert, planned on the device: no
    host sync, static shapes (``T*k + E*(_GROUP_ALIGN-1)`` grouped rows at most), so CUDA graphs capture it."""
    t, k = topk_ids.shape
    e, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # pair index of each sorted position, grouped by expert
    counts = torch.zeros(e, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + _GROUP_ALIGN - 1) // _GROUP_ALIGN * _GROUP_ALIGN
    ends = torch.cumsum(padded, 0)
    expert = flat[order]  # expert of each sorted position
    rank_in_group = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
    row = (ends - padded)[expert] + rank_in_group  # grouped row of each sorted position
    src = torch.zeros(t * k + e * (_GROUP_ALIGN - 1), dtype=torch.long, device=x.device)
    src[row] = order // k  # the token each grouped row reads (pad rows read token 0 and are never used)
    pair_row = torch.empty_like(row)
    pair_row[order] = row
    offs = ends.to(torch.int32)
    # rows past the last group are left unwritten by _grouped_mm, in its output and in its input gradient: zeroed
    # by `where` on both sides, so no stale value reaches a token (or token 0's gradient, which pad rows read)
    used = (torch.arange(src.shape[0], device=x.device) < ends[-1]).unsqueeze(-1)
    h = torch._grouped_mm(torch.where(used, x[src], 0), w_gate_up.transpose(1, 2), offs=offs)
    h = torch.where(used, h, 0)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w_down.transpose(1, 2), offs=offs)
    y = y[pair_row].view(t, k, -1).float()
    return (y * topk_weights.float().unsqueeze(-1)).sum(1).to(x.dtype)


def _split_gate_up(h: torch.Tensor, inter: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up from the gate_up projection's output: halves, or (interleaved, gpt-oss) even and odd columns."""
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    return h[:, :inter], h[:, inter:]


def _fused_moe_fast_eager(x, w_gate_up, w_down, topk_weights, topk_ids, b_gate_up, b_down, interleaved, activation):
    """transformers' GptOssExperts loop: per expert hit, ``x @ W + b`` in x's dtype, the activation, the weighted
    output added with ``index_add_`` in expert order."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for expert in ids.unique().tolist():
        tok, rank = torch.where(ids == expert)
        h = F.linear(x[tok], w_gate_up[expert], None if b_gate_up is None else b_gate_up[expert].to(x.dtype))
        gate, up = _split_gate_up(h, inter, interleaved)
        a = clamped_swiglu_torch(gate, up) if activation == "clamped_swiglu" else F.silu(gate) * up
        y = F.linear(a, w_down[expert], None if b_down is None else b_down[expert].to(x.dtype))
        out.index_add_(0, tok, (y * topk_weights[tok, rank, None].to(x.dtype)).to(x.dtype))
    return out


def _fused_moe_fast(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    if _grouped_mm_ok(x):
        return _fused_moe_fast_grouped(x, w_gate_up, w_down, topk_weights, topk_ids)
    e, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for expert in ids.unique().tolist():
        tok, rank = torch.where(ids == expert)
        h = F.linear(x[tok], w_gate_up[expert])
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(a, w_down[expert]) * topk_weights[tok, rank, None].to(x.dtype)
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def _fused_moe_reference(
    x, w_gate_up, w_down, topk_weights, topk_ids, b_gate_up=None, b_down=None, interleaved=False, activation="silu"
) -> torch.Tensor:
    t, k = topk_ids.shape
    e, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # (token, rank) pairs grouped by expert, in token order
    counts = torch.bincount(flat, minlength=e).tolist()
    xs = x[order // k]
    h_parts, y_parts, start = [], [], 0
    for expert, n in enumerate(counts):
        if n:
            hx = _linear_reference(xs[start : start + n], w_gate_up[expert])
            if b_gate_up is not None:  # added in fp32 before the one cast, as ``linear`` adds a bias
                hx = hx + b_gate_up[expert].float()
            h_parts.append(hx.to(x.dtype))
        start += n
    h = torch.cat(h_parts) if h_parts else x.new_zeros(0, two_i)
    gate, up = _split_gate_up(h, inter, interleaved)
    a = clamped_swiglu(gate, up) if activation == "clamped_swiglu" else silu_and_mul(gate, up)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            y = _linear_reference(a[start : start + n], w_down[expert])
            y_parts.append(y if b_down is None else y + b_down[expert].float())  # stays fp32, as without a bias
        start += n
    y_sorted = torch.cat(y_parts) if y_parts else x.new_zeros(0, x.shape[1], dtype=torch.float32)
    y = y_sorted[torch.argsort(order)].view(t, k, -1)  # back to [token, rank] order
    return _combine_reference(y, topk_weights, x.dtype)


def _combine_reference(y: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``((w_0 y_0) + w_1 y_1) + ...`` in fp32 over ``y [T, k, H]`` in rank order, cast once."""
    w = topk_weights.float()
    out = w[:, 0:1] * y[:, 0]
    for r in range(1, y.shape[1]):
        out = out + w[:, r : r + 1] * y[:, r]
    return out.to(dtype)


def _expert_outputs_reference(x, w_gate_up, w_down, topk_ids) -> torch.Tensor:
    """``[T, k, H]`` fp32: the arithmetic of ``_fused_moe_reference`` up to the combine, for the pairs whose expert
    lies in ``[0, E)``; the other pairs' rows are zeros."""
    t, k = topk_ids.shape
    e, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).long()
    flat = torch.where((flat >= 0) & (flat < e), flat, e)  # held elsewhere: sorted last, never computed
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=e + 1).tolist()
    n_local = sum(counts[:e])
    xs = x[order[:n_local] // k]
    h_parts, start = [], 0
    for expert in range(e):
        n = counts[expert]
        if n:
            h_parts.append(_linear_reference(xs[start : start + n], w_gate_up[expert]).to(x.dtype))
        start += n
    h = torch.cat(h_parts) if h_parts else x.new_zeros(0, two_i)
    a = silu_and_mul(h[:, :inter], h[:, inter:])
    y = x.new_zeros(t * k, x.shape[1], dtype=torch.float32)
    start = 0
    for expert in range(e):
        n = counts[expert]
        if n:
            y[order[start : start + n]] = _linear_reference(a[start : start + n], w_down[expert])
        start += n
    return y.view(t, k, -1)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    gate_up_interleaved: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """``sum_r topk_weights[t, r] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, r]``.

    ``x [T, H]``, ``w_gate_up [E, 2I, H]``, ``w_down [E, H, I]``, ``topk_weights [T, k]`` (fp32), ``topk_ids [T, k]``
    -> ``[T, H]`` in x's dtype. Differentiable in x, both weights and ``topk_weights``.

    gpt-oss's experts (all off by default, which leaves the result as without them): ``b_gate_up [E, 2I]`` and
    ``b_down [E, H]`` expert biases (added in fp32 to the row's fp32 result: gate/up's before its cast, down's to the
    fp32 output before the combine); ``gate_up_interleaved``: gate and up are the even and odd rows of
    ``w_gate_up`` (gpt-oss's ``gate_up_proj``) rather than its two halves; ``activation="clamped_swiglu"``:
    :func:`~vexact_kernels.activation.clamped_swiglu` in place of silu-and-mul. The weights may be transposed views
    (gpt-oss holds ``[E, H, 2I]``): the CPU reference's bits do not depend on the layout. On CUDA tensors the
    invariant backend runs them in the Triton fused MoE (``triton_ops/moe.py``), differentiable in the biases.
    """
    _check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids)
    _check_moe_extras(x, w_gate_up, w_down, b_gate_up, b_down, activation)
    extras = b_gate_up is not None or b_down is not None or gate_up_interleaved or activation != "silu"
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    if extras:
        args = (x, w_gate_up, w_down, topk_weights, topk_ids, b_gate_up, b_down, gate_up_interleaved, activation)
        if get_backend("moe") == "fast":
            return _fused_moe_fast_eager(*args)
        if use_triton(x, w_gate_up, w_down):
            from .triton_ops.moe import triton_fused_moe

            return triton_fused_moe(
                x, w_gate_up, w_down, topk_weights, topk_ids, b_gate_up=b_gate_up, b_down=b_down,
                gate_up_interleaved=gate_up_interleaved, activation=activation,
            )  # fmt: skip
        invariant_device_check("fused_moe", x, w_gate_up, w_down)
        return _fused_moe_reference(*args)
    if get_backend("moe") == "fast":
        return _fused_moe_fast(x, w_gate_up, w_down, topk_weights, topk_ids)
    if use_triton(x, w_gate_up, w_down):
        from .triton_ops.moe import triton_fused_moe

        return triton_fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    invariant_device_check("fused_moe", x, w_gate_up, w_down)
    return _fused_moe_reference(x, w_gate_up, w_down, topk_weights, topk_ids)


def moe_expert_outputs(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Each (token, rank) pair's expert output before the combine: ``[T, k, H]`` fp32, row ``[t, r]`` equal bit for
    bit to what :func:`fused_moe` computes for that pair (each pair row is reduced alone, so which pairs share the
    call changes no bit). Pairs whose id lies outside ``[0, E)`` are not computed and hold zeros: with the experts
    sharded over ranks (expert parallelism), each rank passes ids relative to its first expert, and the pairs of
    other ranks' experts and pad rows fall outside. Invariant backend only; no autograd (inference)."""
    check_float("moe_expert_outputs", "x", x)
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3 or topk_ids.dim() != 2:
        raise ValueError(
            f"moe_expert_outputs: expected x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_ids [T, k]; got "
            f"{tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}, {tuple(topk_ids.shape)}"
        )
    if topk_ids.shape[0] != x.shape[0] or w_gate_up.shape[2] != x.shape[1] or x.dtype != w_gate_up.dtype:
        raise ValueError(
            f"moe_expert_outputs: x {tuple(x.shape)} {x.dtype}, w_gate_up {tuple(w_gate_up.shape)} "
            f"{w_gate_up.dtype}, topk_ids {tuple(topk_ids.shape)} do not agree"
        )
    if get_backend("moe") == "fast":
        raise ValueError("moe_expert_outputs: the invariant moe backend only (expert parallelism keeps the bits)")
    t, k = topk_ids.shape
    if t == 0:
        return x.new_zeros(0, k, x.shape[1], dtype=torch.float32)
    if use_triton(x, w_gate_up, w_down):
        from .triton_ops.moe import triton_moe_expert_outputs

        return triton_moe_expert_outputs(x, w_gate_up, w_down, topk_ids)
    invariant_device_check("moe_expert_outputs", x, w_gate_up, w_down)
    return _expert_outputs_reference(x, w_gate_up, w_down, topk_ids)


def moe_combine(expert_outputs: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = ((w_0 y_0) + w_1 y_1) + ...`` over ``expert_outputs [T, k, H]`` (fp32) in the token's own rank
    order, in fp32, cast once to ``dtype``: :func:`fused_moe`'s combine, so ``moe_combine(moe_expert_outputs(...))``
    is ``fused_moe`` bit for bit, on the device that runs it."""
    if expert_outputs.dim() != 3 or topk_weights.shape != expert_outputs.shape[:2]:
        raise ValueError(
            f"moe_combine: expected expert_outputs [T, k, H] and topk_weights [T, k]; got "
            f"{tuple(expert_outputs.shape)}, {tuple(topk_weights.shape)}"
        )
    if expert_outputs.dtype != torch.float32:
        raise TypeError(f"moe_combine: expert_outputs must be float32; got {expert_outputs.dtype}")
    if get_backend("moe") == "fast":
        raise ValueError("moe_combine: the invariant moe backend only (expert parallelism keeps the bits)")
    t, _, h = expert_outputs.shape
    if t == 0:
        return expert_outputs.new_zeros(0, h, dtype=dtype)
    if use_triton(expert_outputs):
        from .triton_ops.moe import triton_moe_combine

        return triton_moe_combine(expert_outputs, topk_weights, dtype)
    invariant_device_check("moe_combine", expert_outputs)
    return _combine_reference(expert_outputs, topk_weights, dtype)
