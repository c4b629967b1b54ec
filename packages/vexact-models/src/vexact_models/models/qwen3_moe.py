"""Qwen3-MoE: Qwen3's attention and blocks, with a sparse MoE block (router + experts) in place of the dense MLP on
every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``.

Names and layout are transformers': ``mlp.gate.weight [E, H]``, ``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``; published checkpoints (one tensor per expert) load through the loader's
per-expert mapping. The routing and the expert MLPs are vexact-kernels' ``moe_route`` and ``fused_moe``, so a token's
output does not depend on how many tokens its experts received or on which driver ran it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import SparseMoeBlock
from .dense import DenseMLP, Qwen3Config, Qwen3ForCausalLM


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE (HF ``model_type: qwen3_moe``): Qwen3 attention, sparse MoE blocks with dense layers mixed in.

    Layer ``i`` is sparse when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; dense layers
    use ``intermediate_size``, experts ``moe_intermediate_size``.
    """

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    model_type: str = "qwen3_moe"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen3MoeConfig.{name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig: num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"Qwen3MoeConfig.mlp_only_layers has {bad}, outside the layers [0, {self.num_hidden_layers})"
            )
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"Qwen3MoeConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}")

    @classmethod
    def from_hf_dict(cls, d: dict):
        d = dict(d)
        # transformers 5.x writes the expert count as ``num_local_experts`` (its attribute map); published Qwen3-MoE
        # checkpoints write ``num_experts``
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
        missing = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") if k not in d]
        if missing:
            raise ValueError(f"qwen3_moe config.json lacks {missing} (num_experts may be given as num_local_experts)")
        return super().from_hf_dict(d)

    def is_sparse_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def to_hf_dict(self) -> dict:
        d = super().to_hf_dict()
        d["architectures"] = ["Qwen3MoeForCausalLM"]
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["output_router_logits"] = False
        return d


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
