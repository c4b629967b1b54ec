"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA attention with biases on q/k/v/o, a learned sink logit per head, a
sliding window on alternate layers (``layer_types``), YaRN rope; every MLP a sparse MoE (``GptOssMoeBlock``: a biased
router, top-k of its logits then softmax over the k, experts with biases, gate/up interleaved in one
``gate_up_proj``, the clamped SwiGLU); pre-norm residual blocks, as the dense decoder's.

Names and layout are transformers' ``GptOssForCausalLM``: ``self_attn.{q,k,v,o}_proj.{weight,bias}``,
``self_attn.sinks [Hq]``, ``mlp.router.{weight,bias}``, ``mlp.experts.{gate_up_proj [E, H, 2I], gate_up_proj_bias,
down_proj [E, I, H], down_proj_bias}`` (stored stacked in checkpoints, as held); released MXFP4 checkpoints
(``..._blocks`` / ``..._scales``) are dequantised to bf16 at load (``mxfp4.py``). The window and the sinks run in
vexact-kernels' attention (``window=``, ``sinks=``), the same key blocks in every path, so the engine and the trainer
agree bit for bit on sliding and full layers alike, on the CPU reference and on the Triton kernels (CUDA) alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..config import (
    ARCHITECTURES,
    check_heads,
    check_norm_rope_dtype,
    check_positive_ints,
)
from ..layers import GptOssMoeBlock, RotaryEmbedding
from .deepseek_v3 import YarnScaling, yarn_config_from_hf
from .dense import DenseAttention, DenseDecoderLayer, DenseForCausalLM, GQAShape

LAYER_TYPES = ("sliding_attention", "full_attention")
SWIGLU_LIMIT = 7.0  # vexact_kernels.clamped_swiglu's limit; gpt-oss's config.json may repeat it (swiglu_limit)


@dataclass(frozen=True)
class GptOssConfig(GQAShape):
    """gpt-oss (HF ``model_type: gpt_oss``). Layer ``i`` attends within ``sliding_window`` keys when
    ``layer_types[i] == "sliding_attention"`` (default: even layers sliding, odd layers full), to every earlier key
    otherwise. ``rope_scaling``: YaRN (transformers' ``rope_parameters``, ``truncate`` false in the released
    configs) or None. Its first fields, ``vocab_size`` to ``head_dim``, are :class:`GQAShape`'s."""

    # the kernels run this family's window, so sequences may outrun it (the shell and the engine read this)
    windowed_attention: ClassVar[bool] = True
    # checkpoints hold the experts stacked, as the model does (no per-expert names)
    stacked_expert_checkpoint: ClassVar[bool] = True
    # the dense attention's switches (models/dense.py): no q/k norm, ``attention_bias`` on all four projections
    qk_norm: ClassVar[bool] = False
    qkv_bias = property(lambda self: self.attention_bias)
    o_bias = property(lambda self: self.attention_bias)

    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int = 128
    layer_types: tuple[str, ...] | None = None
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150_000.0
    rope_scaling: YarnScaling | None = None
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    swiglu_limit: float = SWIGLU_LIMIT
    router_aux_loss_coef: float = 0.001  # transformers GptOssConfig default; the released configs set 0.9
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str = "gpt_oss"

    def __post_init__(self) -> None:
        c = "GptOssConfig"
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
            "max_position_embeddings",
        )  # fmt: skip
        check_positive_ints(c, self, positive)
        check_heads(c, self.num_attention_heads, self.num_key_value_heads, self.head_dim)
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"{c}: num_experts_per_tok ({self.num_experts_per_tok}) > num_local_experts ({self.num_local_experts})"
            )
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", tuple(LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(
                f"{c}.layer_types must list {self.num_hidden_layers} of {LAYER_TYPES}; got {list(self.layer_types)}"
            )
        if self.swiglu_limit != SWIGLU_LIMIT:
            raise ValueError(f"{c}.swiglu_limit must be {SWIGLU_LIMIT} (the kernels' clamp), got {self.swiglu_limit!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"{c}.hidden_act must be 'silu' (gpt-oss's clamped SwiGLU), got {self.hidden_act!r}")
        check_norm_rope_dtype(c, self, YarnScaling)

    @property
    def num_experts(self) -> int:
        """``num_local_experts`` under the name the trainer's router outputs use."""
        return self.num_local_experts

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s attention window: ``sliding_window`` on sliding layers, None (every earlier key) on full."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_hf_dict(cls, d: dict):
        d = dict(d)
        quant = d.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else None
            if method != "mxfp4":
                raise ValueError(
                    f"gpt_oss config.json has quantization_config (quant_method {method!r}): only mxfp4 experts are "
                    "supported (dequantised to bf16 at load)"
                )
        if "num_local_experts" not in d and "num_experts" in d:
            d["num_local_experts"] = d["num_experts"]
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        return yarn_config_from_hf(cls, d, ("rope_parameters", "rope_scaling"), "gpt_oss: rope_parameters.rope_type")

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["architectures"] = [ARCHITECTURES[self.model_type]]
        d["layer_types"] = list(self.layer_types)
        del d["rope_scaling"], d["rope_theta"]
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            yarn = {k: v for k, v in dataclasses.asdict(self.rope_scaling).items() if v is not None}
            rope = {"rope_type": "yarn", "rope_theta": self.rope_theta, **yarn}
        d["rope_parameters"] = rope
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        return d


def _layer(cfg: GptOssConfig, rotary: RotaryEmbedding, i: int) -> DenseDecoderLayer:
    """Layer ``i``: the dense decoder layer, its attention with layer ``i``'s window and a sink per head, its MLP the
    sparse MoE."""
    attn = DenseAttention(cfg, rotary, window=cfg.layer_window(i), sinks=True)
    moe = GptOssMoeBlock(
        cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size, cfg.dtype
    )
    return DenseDecoderLayer(cfg, rotary, moe, attn)


class GptOssForCausalLM(DenseForCausalLM):
    """The dense decoder's causal-LM shell (input checks, ``logits``, ``logprobs``) around the gpt-oss body."""

    config_class = GptOssConfig

    def __init__(self, cfg: GptOssConfig):
        super().__init__(cfg, make_layer=_layer)
