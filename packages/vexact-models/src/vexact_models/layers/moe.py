"""Sparse MoE block on vexact-kernels' ``moe_route`` + ``fused_moe``, with transformers' names and layout.

Parameters: ``gate.weight [E, H]`` (the router), ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj
[E, H, I]`` (stacked, as transformers holds them in memory). Published checkpoints store one tensor per expert
(``experts.{i}.gate_proj.weight`` ...): :func:`checkpoint_pieces` maps a stacked parameter to those names and views,
which is how the loader, the checkpoint writer and the weight export see it.

Router outputs for RL: inside :func:`record_router`, every sparse block appends its fp32 router logits and chosen
experts to the list the context yields; :func:`load_balancing_loss` turns the logits into transformers' auxiliary
loss (``router_aux_loss_coef`` times it is what an HF model adds to its loss).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

import vexact_kernels as vk

from .linear import Linear

FP32 = torch.float32
# Checkpoint tensors held, loaded and sent in fp32 whatever the model dtype (suffixes of their HF names).
FP32_WEIGHTS = ("mlp.gate.e_score_correction_bias",)


@dataclass
class RouterOutput:
    logits: torch.Tensor  # [T, E] fp32, before the softmax
    topk_ids: torch.Tensor  # [T, k] chosen experts, best first


_recorder: contextvars.ContextVar[list[RouterOutput] | None] = contextvars.ContextVar("vexact_router", default=None)


@contextlib.contextmanager
def record_router() -> Iterator[list[RouterOutput]]:
    """Collect each sparse block's :class:`RouterOutput` of the forwards run inside (one per sparse layer and
    forward, in layer order). Dense models leave the list empty."""
    out: list[RouterOutput] = []
    token = _recorder.set(out)
    try:
        yield out
    finally:
        _recorder.reset(token)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum ``[T, H]`` for ``x [T, H]`` routed to ``topk_ids [T, k]``. A module of
        its own so that expert parallelism, applied from outside, can put a sharded one in its place."""
        return vk.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router (fp32 logits), softmax top-k routing, the experts' SwiGLU MLPs and the weighted combine."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden: int,
        inter: int,
        norm_topk_prob: bool,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden, num_experts, False, dtype)  # read in fp32 out, not through its forward
        self.experts = Experts(num_experts, hidden, inter, dtype)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] fp32, topk_ids [T, k])`` from fp32 router logits ``[T, E]``."""
        return vk.moe_route(logits, self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = vk.linear(x, self.gate.weight, out_dtype=torch.float32)  # [T, E]
        weights, ids = self.route(logits)  # [T, k] each
        rec = _recorder.get()
        if rec is not None:
            rec.append(RouterOutput(logits, ids))
        return self.experts(x, weights, ids)


class DeepseekMoeBlock(SparseMoeBlock):
    """DeepSeek's MoE (V3, Moonlight): the sparse block with vexact-kernels' ``moe_route_grouped`` routing (sigmoid
    or softmax scores; ``gate.e_score_correction_bias`` added for the choice only; group-limited top-k; weights from
    the unbiased scores, renormalised, times ``routed_scaling_factor``) and the shared experts, one dense MLP of the
    caller's making, added at one fixed place: ``out = fused_moe(routed) + shared_experts(x)`` (in x's dtype, as
    transformers adds them).

    The bias is a persistent fp32 buffer, as in transformers and the published checkpoints: it is loaded, saved and
    exported with the weights under its HF name, but no dtype cast of the model touches it where it matters: FSDP's
    mixed precision casts parameters only, the engine builds the model in its dtype around an fp32 buffer, and weight
    export sends it in fp32 (:func:`weight_dtype`). Both drivers therefore route with the checkpoint's fp32 value,
    as transformers does, also at a near-tie below bf16 resolution. It gets no gradient (DeepSeek updates it by a
    load-balancing rule outside the loss).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden: int,
        inter: int,
        shared_experts: nn.Module,
        *,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        scoring_func: str,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(num_experts, top_k, hidden, inter, norm_topk_prob, dtype)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=FP32), persistent=True)
        self.shared_experts = shared_experts
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor, self.scoring_func = routed_scaling_factor, scoring_func

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vk.moe_route_grouped(
            logits,
            self.top_k,
            bias=self.gate.e_score_correction_bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            scoring_func=self.scoring_func,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class GptOssExperts(nn.Module):
    """gpt-oss's experts in transformers' names and layout: ``gate_up_proj [E, H, 2I]`` (gate and up interleaved in
    its columns: gate even, up odd) with ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]`` with
    ``down_proj_bias [E, H]``. Checkpoints store them stacked, as held (:func:`checkpoint_pieces` with
    ``stacked=True``)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter, dtype=dtype))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden, dtype=dtype))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))


class GptOssMoeBlock(nn.Module):
    """gpt-oss's MoE: a router with a bias (``router.weight [E, H]``, ``router.bias [E]``; fp32 logits), the top-k
    of its logits then a softmax over those k (``moe_route(topk_before_softmax=True)``, ties to the lower index), and
    the experts through ``fused_moe`` with their biases, interleaved gate/up and the clamped SwiGLU."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.top_k = top_k
        self.router = Linear(hidden, num_experts, True, dtype)  # read in fp32 out, not through its forward
        self.experts = GptOssExperts(num_experts, hidden, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = vk.linear(x, self.router.weight, self.router.bias, out_dtype=torch.float32)  # [T, E]
        weights, ids = vk.moe_route(logits, self.top_k, topk_before_softmax=True)  # [T, k] each
        rec = _recorder.get()
        if rec is not None:
            rec.append(RouterOutput(logits, ids))
        ex = self.experts
        return vk.fused_moe(
            x, ex.gate_up_proj.transpose(1, 2), ex.down_proj.transpose(1, 2), weights, ids,
            b_gate_up=ex.gate_up_proj_bias, b_down=ex.down_proj_bias, gate_up_interleaved=True,
            activation="clamped_swiglu",
        )  # fmt: skip


def load_balancing_loss(router: list[RouterOutput], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over all recorded layers and tokens: ``E * sum_e f_e * P_e`` with
    ``f_e`` the share of (token, rank) slots routed to expert ``e`` and ``P_e`` its mean router probability."""
    if not router:
        raise ValueError("load_balancing_loss: no router outputs recorded (is this an MoE model?)")
    logits = torch.cat([r.logits for r in router])  # [L*T, E]
    probs = torch.softmax(logits.float(), dim=-1)
    ids = torch.cat([r.topk_ids for r in router])[:, :top_k]
    # share of each (rank, expert) slot: counts / tokens, without a [L*T, k, E] one-hot (the counts are exact
    # integers, so this equals the one-hot mean bit for bit)
    counts = torch.zeros(top_k, num_experts, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids.t().contiguous(), torch.ones(ids.t().shape, dtype=torch.float32, device=ids.device))
    tokens_per_expert = counts / ids.shape[0]  # [k, E]
    prob_per_expert = probs.mean(dim=0)  # [E]
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * num_experts


def weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype in which the checkpoint tensor ``name`` is held and sent when the model's dtype is ``dtype``: fp32
    for DeepSeek's ``e_score_correction_bias`` (an fp32 buffer), ``dtype`` for every other weight."""
    return FP32 if name.endswith(FP32_WEIGHTS) else dtype


def named_weights(model: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every checkpoint tensor of ``model``, module by module: its parameters, then its
    persistent buffers (DeepSeek's ``e_score_correction_bias``), the order of ``state_dict``. Non-persistent buffers
    (rotary tables) are left out; a tied tensor appears once, under its first name, unless ``remove_duplicate`` is
    False."""
    seen: set[int] = set()
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        buffers = [(n, b) for n, b in mod._buffers.items() if n not in mod._non_persistent_buffers_set]
        for n, t in [*mod._parameters.items(), *buffers]:
            if t is None or (remove_duplicate and id(t) in seen):
                continue
            seen.add(id(t))
            yield prefix + n, t


_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def stacked_experts(model: nn.Module) -> bool:
    """Whether ``model``'s checkpoints hold its expert tensors stacked, as the model holds them (gpt-oss:
    ``config.stacked_expert_checkpoint``), rather than one tensor per expert and projection."""
    return bool(getattr(getattr(model, "config", None), "stacked_expert_checkpoint", False))


def checkpoint_pieces(name: str, tensor: torch.Tensor, stacked: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The published checkpoint's ``(name, view)`` pairs of a model tensor: one per expert and projection for a
    stacked expert parameter, the tensor itself under its own name otherwise. Views share the tensor's storage.
    ``stacked``: the family's checkpoints store stacked expert tensors whole (:func:`stacked_experts`)."""
    m = None if stacked else _STACKED.match(name)
    if m is None:
        return [(name, tensor)]
    prefix = m["prefix"]
    if m["proj"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    inter = tensor.shape[1] // 2
    out = []
    for e in range(tensor.shape[0]):
        out.append((f"{prefix}.{e}.gate_proj.weight", tensor[e, :inter]))
        out.append((f"{prefix}.{e}.up_proj.weight", tensor[e, inter:]))
    return out
