"""Qwen3-MoE: Qwen3's attention and blocks, with a sparse MoE block (router + experts) in place of the dense MLP on
every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``.

Names and layout are transformers': ``mlp.gate.weight [E, H]``, ``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``; published checkpoints (one tensor per expert) load through the loader's
per-expert mapping. The routing and the expert MLPs are vexact-kernels' ``moe_route`` and ``fused_moe``, so a token's
output does not depend on how many tokens its experts received or on which driver ran it.
"""

from __future__ import annotations

from ..config import Qwen3MoeConfig
from ..layers import SparseMoeBlock
from .dense import DenseMLP, Qwen3ForCausalLM


def _mlp(cfg: Qwen3MoeConfig, i: int):
    if not cfg.is_sparse_layer(i):
        return DenseMLP(cfg)
    return SparseMoeBlock(
        cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, cfg.norm_topk_prob,
        cfg.dtype,
    )  # fmt: skip


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_class = Qwen3MoeConfig

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__(cfg, make_mlp=_mlp)
