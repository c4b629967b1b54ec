"""Tiny checkpoints of every family for tests, contracts and the demo, made deterministically.

Weights come from a seeded ``torch.Generator`` on CPU; the tokenizer is byte-level (256 byte tokens plus
specials), built with the ``tokenizers`` library when it is installed. The demo's default checkpoint
(``assets/tiny-qwen3``) and one per family (``assets/tiny-<family>``) are committed;
``scripts/fixtures/make_tiny_checkpoint.py`` rewrites them.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import torch

from .layers.moe import named_weights
from .loader import _reset_buffers, save_checkpoint
from .models import (
    CONFIG_CLASSES,
    MODEL_CLASSES,
    DeepseekV3Config,
    DenseConfig,
    GptOssConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    YarnScaling,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB = 256

# Real Qwen3 shapes (the Hugging Face config.json values), as overrides of tiny_qwen3_config: random-weight models
# at real size for the GPU contracts, benchmarks and checks. The tiny byte tokenizer still works with them (its ids
# are a subset of the vocabulary).
QWEN3_SHAPES = {
    "qwen3-0.6b": dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
}  # fmt: skip

# Real Qwen3-MoE shapes, as overrides of tiny_qwen3_moe_config.
QWEN3_MOE_SHAPES = {
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
        tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, mlp_only_layers=(),
    ),
    "qwen3-235b-a22b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
        tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
        norm_topk_prob=True, mlp_only_layers=(),
    ),
}  # fmt: skip

# Real DeepSeek-V3-family shapes (the published config.json values), as overrides of tiny_deepseek_v3_config.
# DeepSeek-V3's published weights are FP8 (not loadable here); its shape is for random-weight models.
DEEPSEEK_V3_SHAPES = {
    "moonlight-16b-a3b": dict(
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
        first_k_dense_replace=1, moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc",
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None,
        tie_word_embeddings=False,
    ),
    "deepseek-v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=3, moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc",
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        tie_word_embeddings=False,
    ),
}  # fmt: skip


# Real gpt-oss shapes (the released config.json values; their experts ship in MXFP4, which loads dequantised to bf16),
# as overrides of tiny_gpt_oss_config.
_GPT_OSS_YARN = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                            truncate=False)  # fmt: skip
GPT_OSS_SHAPES = {
    "gpt-oss-20b": dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=None, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling=_GPT_OSS_YARN, tie_word_embeddings=False, router_aux_loss_coef=0.9,
    ),
    "gpt-oss-120b": dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
        layer_types=None, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling=_GPT_OSS_YARN, tie_word_embeddings=False, router_aux_loss_coef=0.9,
    ),
}  # fmt: skip


_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)  # fmt: skip

# Real shapes of the other dense families (their Hugging Face config.json values), as overrides of
# tiny_config(family). Published Qwen2.5 configs set use_sliding_window false (no window); Mistral-7B-v0.1 sets a
# 4096 window, so it runs sequences of up to 4096 tokens.
LLAMA_SHAPES = {
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_scaling=_LLAMA3_ROPE,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
    ),
    "llama-3.2-3b": dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
    ),
}  # fmt: skip
QWEN2_SHAPES = {
    "qwen2.5-1.5b": dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=131072, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=131072, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
MISTRAL_SHAPES = {
    "mistral-7b-v0.1": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=10_000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=4096,
    ),
}  # fmt: skip


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """A two-layer, 64-wide Qwen3 with GQA (4 query heads, 2 KV heads) and a byte-level vocabulary."""
    base = dict(
        vocab_size=BYTE_VOCAB + len(SPECIAL_TOKENS) + 13,  # 272: padded like real vocabularies are
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=BYTE_VOCAB + 1,
        eos_token_id=BYTE_VOCAB,
    )
    base.update(overrides)
    return Qwen3Config(**base)


def tiny_qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    """The tiny Qwen3 with three layers, the middle one dense (``mlp_only_layers``), the others sparse: 8 experts of
    width 32, top-2, renormalised."""
    base = dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,),
        norm_topk_prob=True,
    )  # fmt: skip
    base.update(overrides)
    return Qwen3MoeConfig(**{**tiny_qwen3_config().__dict__, "model_type": "qwen3_moe", **base})


def tiny_deepseek_v3_config(**overrides) -> DeepseekV3Config:
    """A three-layer, 64-wide DeepSeek-V3: layer 0 dense, layers 1-2 MoE (8 experts of width 32 in 2 groups, 1 group
    kept, top-2, sigmoid with the correction bias, scaled by 2.5, one shared expert); MLA with a q LoRA of 48, a KV
    latent of 32, 4 heads of 16 + 8 (rope) / 16 (value); YaRN rope (factor 4, mscale_all_dim set, so the softmax
    scale and the cos/sin tables both carry it); the byte-level vocabulary of the tiny Qwen3."""
    q = tiny_qwen3_config()
    base = dict(
        vocab_size=q.vocab_size, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, max_position_embeddings=512,
        rope_theta=10_000.0,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.5),
        bos_token_id=q.bos_token_id, eos_token_id=q.eos_token_id,
    )  # fmt: skip
    base.update(overrides)
    return DeepseekV3Config(**base)


def tiny_gpt_oss_config(**overrides) -> GptOssConfig:
    """A two-layer, 64-wide gpt-oss: layer 0 sliding (a window of 24: not a multiple of the attention kernels' key
    block of 16, and shorter than the golden workload's sequences, so blocks are skipped), layer 1 full; 4 query
    heads of 16 with a sink each, 2 KV heads; 8 experts of width 32, top-4; YaRN rope (factor 4 over an original
    context of 128, untruncated, as the released configs); the byte-level vocabulary of the tiny Qwen3."""
    q = tiny_qwen3_config()
    base = dict(
        vocab_size=q.vocab_size, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=24,
        max_position_embeddings=512, rope_theta=150_000.0,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=128, truncate=False),
        bos_token_id=q.bos_token_id, eos_token_id=q.eos_token_id,
    )  # fmt: skip
    base.update(overrides)
    return GptOssConfig(**base)


# What each tiny dense family adds to tiny_qwen3_config's shape (q/k norm and biases follow from the family):
# llama: tied embeddings and llama3 rope with an original context of 64, so its low-, medium- and high-frequency
# bands all occur at head_dim 16; qwen2: q/k/v biases; mistral: a 4096 window, which a 512-position model never fills.
_TINY_FAMILIES = {
    "qwen3": {},
    "llama": dict(rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 64}),
    "qwen2": {},
    "mistral": dict(rms_norm_eps=1e-5, sliding_window=4096),
}  # fmt: skip


def tiny_config(family: str = "qwen3", **overrides) -> DenseConfig:
    """The tiny two-layer model of a dense family (``qwen3``, ``qwen2``, ``llama``, ``mistral``)."""
    if family not in _TINY_FAMILIES:
        raise ValueError(f"no tiny config for family {family!r}; have {sorted(_TINY_FAMILIES)}")
    base = {**tiny_qwen3_config().__dict__, "model_type": family, **_TINY_FAMILIES[family], **overrides}
    return CONFIG_CLASSES[family](**base)


# Extra committed checkpoints beside one per family, for the golden contracts: shapes under which more of the promised
# orders change bits. With top-2 routing, ``a + b == b + a`` hides the order of the MoE combine and of the weights'
# renormalisation; these route top-8 (as Qwen3-30B-A3B) and top-6 (as Moonlight). An fp32 order changes a last bit,
# which the cast to bf16 keeps only near a rounding boundary (about 5e-5 of the combine's outputs here) and the
# residual add keeps only where the experts' output is not small beside the residual: so these are 512 wide (more
# values per token), every layer but DeepSeek's first is sparse, and the experts' down projection is scaled by 8
# (``weight_scales``). The families' tiny checkpoints have heads of 16, which FA4 does not run
# (``vexact_kernels.attention.FA4_MIN_HEAD_DIM``); ``qwen3_hd64`` has heads of 64, so its golden fixtures under
# ``VEXACT_ATTENTION=fa4`` hold FA4's own bits.
# name -> (family, overrides of that family's tiny config, random_model's embed_std and factors applied to the random
# weights by name suffix).
_WIDE_MOE = dict(
    hidden_size=512,
    num_hidden_layers=4,
    mlp_only_layers=(),
    num_experts=16,
    moe_intermediate_size=8,
    tie_word_embeddings=True,
)
# tied embeddings of 512 drawn N(0, 1) would give logits in the tens (one token always): N(0, 0.1^2) keeps them near
# the family checkpoints' spread, and the residual stream small beside the experts' output
_LOUD_EXPERTS = dict(embed_std=0.1, weight_scales={"experts.down_proj": 8.0})
TINY_VARIANTS = {
    "qwen3_moe_top8": ("qwen3_moe", dict(_WIDE_MOE, num_experts_per_tok=8), _LOUD_EXPERTS),
    "qwen3_moe_top8_raw": ("qwen3_moe", dict(_WIDE_MOE, num_experts_per_tok=8, norm_topk_prob=False), _LOUD_EXPERTS),
    "deepseek_v3_top6": ("deepseek_v3", dict(hidden_size=512, intermediate_size=32, num_hidden_layers=4,
                                             n_routed_experts=16, moe_intermediate_size=8, n_group=4, topk_group=2,
                                             num_experts_per_tok=6, tie_word_embeddings=True), _LOUD_EXPERTS),
    "qwen3_hd64": ("qwen3", dict(head_dim=64), dict(embed_std=1.0, weight_scales={})),
}  # fmt: skip
FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral", "deepseek_v3", "gpt_oss")
# random_model's embed_std and weight factors of a family's own checkpoint, where not the defaults: gpt-oss's gate_up
# times 4 (exact in bf16), so that some gate and up values pass the clamped SwiGLU's limit of 7
_FAMILY_EXTRAS = {"gpt_oss": dict(embed_std=1.0, weight_scales={"experts.gate_up_proj": 4.0})}
# Every committed tiny checkpoint: one per family, then the variants.
TINY_CHECKPOINTS = FAMILIES + tuple(TINY_VARIANTS)


def tiny_checkpoint_config(name: str):
    """The config of the committed tiny checkpoint ``name`` (a family or a :data:`TINY_VARIANTS` key)."""
    if name not in TINY_CHECKPOINTS:
        raise ValueError(f"no tiny checkpoint {name!r}; have {list(TINY_CHECKPOINTS)}")
    family, overrides, _ = TINY_VARIANTS.get(name, (name, {}, {}))
    if family == "qwen3_moe":
        return tiny_qwen3_moe_config(**overrides)
    if family == "deepseek_v3":
        return tiny_deepseek_v3_config(**overrides)
    if family == "gpt_oss":
        return tiny_gpt_oss_config(**overrides)
    return tiny_config(family, **overrides)


def random_model(cfg: Qwen3Config, seed: int = 0, embed_std: float = 1.0, device: str | torch.device = "cpu"):
    """A model with deterministic random weights: linear ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), embeddings
    ~ N(0, embed_std^2) (use a small std for big tied models, whose logits otherwise reach the hundreds).

    ``device``: where the weights are drawn and kept (a generator of that device: a GPU draws a real-sized MoE in
    seconds, but its weights differ from the CPU's for the same seed)."""
    device = torch.device(device)
    g = torch.Generator(device).manual_seed(seed)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.model_type](cfg)
    model = model.to_empty(device=device)
    _reset_buffers(model, cfg)  # rotary tables (built on CPU) and tied weights
    model.model.rotary_emb.to(device)
    with torch.no_grad():
        for name, p in named_weights(model):  # parameters and the persistent buffers, module by module
            rand = torch.randn(p.shape, generator=g, device=device)
            if name.endswith("norm.weight") or "layernorm" in name:
                w = 1.0 + 0.1 * rand
            elif "embed_tokens" in name:
                w = rand * embed_std
            else:
                w = rand / math.sqrt(p.shape[-1])
            p.copy_(w.to(p.dtype))
    return model.eval().requires_grad_(False)


def write_tokenizer(path: str | Path) -> None:
    """A byte-level BPE tokenizer with no merges (one token per byte) and Qwen-style special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "bos_token": "<|im_start|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 512,
            },
            indent=2,
        )
        + "\n"
    )


def make_tiny_checkpoint(
    path: str | Path, cfg: Qwen3Config | None = None, seed: int = 0, tokenizer: bool = True, **save_kw
) -> Path:
    """Write a complete HF-style checkpoint (config.json, safetensors, tokenizer) and return its path."""
    path = Path(path)
    cfg = cfg or tiny_qwen3_config()
    save_checkpoint(random_model(cfg, seed), path, **save_kw)
    if tokenizer:
        write_tokenizer(path)
    return path


def write_tiny_checkpoint(name: str, path: str | Path | None = None) -> Path:
    """Write the committed tiny checkpoint ``name`` (seed 0; a variant's ``embed_std`` and ``weight_scales``) to
    ``path`` (default: over the committed one, ``default_checkpoint(name)``)."""
    cfg = tiny_checkpoint_config(name)
    default = _FAMILY_EXTRAS.get(name, dict(embed_std=1.0, weight_scales={}))
    extras = TINY_VARIANTS[name][2] if name in TINY_VARIANTS else default
    model = random_model(cfg, seed=0, embed_std=extras["embed_std"])
    with torch.no_grad():
        for weight_name, w in named_weights(model):
            for suffix, factor in extras["weight_scales"].items():
                if weight_name.endswith(suffix):
                    w.mul_(factor)  # a power of two: exact in bf16
    path = Path(path) if path is not None else default_checkpoint(name)
    save_checkpoint(model, path)
    write_tokenizer(path)
    return path


def default_checkpoint(family: str = "qwen3") -> Path:
    """The committed tiny checkpoint of a family (``qwen3``: the demo's; ``qwen3_moe``, ``qwen2``, ``llama``,
    ``mistral``, ``deepseek_v3``, ``gpt_oss``) or of a variant (:data:`TINY_VARIANTS`: ``qwen3_moe_top4``, ...), as
    the golden fixtures use them: ``assets/tiny-<name with dashes>``."""
    if family not in TINY_CHECKPOINTS:
        raise ValueError(f"no committed tiny checkpoint {family!r}; have {list(TINY_CHECKPOINTS)}")
    return Path(str(resources.files("vexact_models") / "assets" / ("tiny-" + family.replace("_", "-"))))
