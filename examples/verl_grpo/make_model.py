"""Write a random-weights checkpoint (Qwen3 by default) verl can train, for machines without a hub (the GPU device).

The model is vexact's byte-level Qwen3 (``vexact_models.tiny_qwen3_config``, widened with ``--hidden``/``--layers``)
saved in HF layout, plus a Qwen-style chat template so verl's dataset code can format prompts. It learns nothing
useful about arithmetic in 20 steps; it exercises every part of a verl GRPO run with the vexact rollout, and the
rollout/actor mismatch metrics are meaningful on it. Use a real Qwen3 checkpoint (MODEL=...) where you have one.

``python examples/verl_grpo/make_model.py --out data/qwen3-random`` then ``MODEL=data/qwen3-random bash
examples/verl_grpo/run_grpo.sh``.

``--shape NAME`` takes the widths of a real model (its config.json: ``SHAPES`` below, from vexact-models' tables):
``qwen3-1.7b``, ``qwen3-8b``, ``qwen3-30b-a3b``, ``llama-3.1-8b``, ``r1-distill-qwen-1.5b``
(DeepSeek-R1-Distill-Qwen-1.5B, a Qwen2), ``moonlight-16b-a3b`` (a DeepSeek-V3) and ``gpt-oss-20b`` (bf16 experts;
sliding and full layers alternate from the first), at ``--layers`` depth (default:
the model's own), with a context of ``--context`` tokens (default 1024). ``--vocab byte`` (the default) keeps the byte
vocabulary (272 ids: the GPU machines have no hub tokenizer); ``--vocab real`` keeps the model's own vocabulary size
(151,936 for Qwen3) with ``full_vocab.py``'s tokenizer, which has a token for every id the random model can sample,
and Qwen3's special-token ids (EOS ``<|im_end|>`` 151,645, pad ``<|endoftext|>`` 151,643). Qwen3 shapes only.

``--family qwen2`` / ``--family llama`` write that dense family at the ``--hidden`` width instead (Qwen2's q/k/v
biases; Llama's llama3 rope and tied head). ``--family deepseek_v3`` writes a DeepSeek-V3 / Moonlight-style model
(``tiny_deepseek_v3_config`` widened: MLA with 128/64/128 head dims and a KV latent of ``--hidden / 2``, the first
layer dense, ``--experts`` routed experts (default 16) in 4 groups with 2 kept, top ``--top-k``, 1 shared expert, YaRN
rope), e.g. ``--family deepseek_v3 --hidden 1024 --layers 8 --experts 32``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

from vexact_models import (
    DEEPSEEK_V3_SHAPES,
    GPT_OSS_SHAPES,
    LLAMA_SHAPES,
    QWEN2_SHAPES,
    QWEN3_MOE_SHAPES,
    QWEN3_SHAPES,
    default_checkpoint,
    make_tiny_checkpoint,
    random_model,
    save_checkpoint,
    tiny_config,
    tiny_deepseek_v3_config,
    tiny_gpt_oss_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# DeepSeek-V3's special tokens (fullwidth bar U+FF5C, lower one-eighth block U+2581) and its chat layout: verl picks
# its DeepSeek token builder from model_type deepseek_v3, and that builder requires the end-of-sentence token.
DS_BOS, DS_EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
DS_USER, DS_ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
DEEPSEEK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}" + DS_USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + DS_ASSISTANT + "{{ m['content'] }}" + DS_EOS + "{% else %}"
    "{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}" + DS_ASSISTANT + "{% endif %}"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("data/qwen3-random"))
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (head_dim 64, 2 query heads per KV head)")
    ap.add_argument("--layers", type=int, default=None, help="depth (default 4, or the --shape model's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=["qwen3", "qwen2", "llama", "deepseek_v3"], default="qwen3")
    ap.add_argument("--experts", type=int, default=0, help="> 0: a Qwen3-MoE with this many experts in every layer")
    ap.add_argument("--top-k", type=int, default=4, help="experts per token (with --experts)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a real model's widths (overrides --hidden/--experts)")
    ap.add_argument(
        "--vocab",
        choices=["byte", "real"],
        default="byte",
        help="with --shape: the byte vocabulary (272) or the model's own with full_vocab.py's tokenizer",
    )
    ap.add_argument("--context", type=int, default=1024, help="with --shape: max_position_embeddings")  # fmt: skip
    args = ap.parse_args()
    args.layers_given = args.layers is not None
    args.layers = 4 if args.layers is None else args.layers
    if args.vocab == "real" and not (args.shape or "").startswith("qwen3"):
        raise ValueError(f"--vocab real: Qwen3 shapes only (full_vocab.py is Qwen3's layout); got --shape {args.shape}")
    if args.shape:
        return _write(args, _shaped(args))
    if args.hidden < 64 or args.hidden % 64:
        raise ValueError(f"--hidden must be a positive multiple of 64, got {args.hidden}")
    if args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    heads = args.hidden // 64
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=2 * heads,
        num_key_value_heads=heads,
        head_dim=64,
        max_position_embeddings=1024,
    )
    if args.family == "deepseek_v3":
        args.experts = args.experts or 16
        cfg = _deepseek_v3(args)
    elif args.experts:
        moe = dict(num_experts=args.experts, num_experts_per_tok=args.top_k, mlp_only_layers=())
        cfg = tiny_qwen3_moe_config(**shape, **moe, moe_intermediate_size=args.hidden // 2)
    elif args.family in ("qwen2", "llama"):
        cfg = tiny_config(args.family, **shape)  # the family's tiny traits (q/k/v biases; llama3 rope, tied head)
    else:
        cfg = tiny_qwen3_config(**shape)
    _write(args, cfg)


# The widths of real checkpoints (vexact-models' tables of their config.json values), at a depth of choice; vocabulary:
# the byte tokenizer's, context 1024. name -> (family, the model's config values).
SHAPES = {
    "qwen3-1.7b": ("qwen3", QWEN3_SHAPES["qwen3-1.7b"]),
    "qwen3-8b": ("qwen3", QWEN3_SHAPES["qwen3-8b"]),
    "qwen3-30b-a3b": ("qwen3_moe", QWEN3_MOE_SHAPES["qwen3-30b-a3b"]),
    "llama-3.1-8b": ("llama", LLAMA_SHAPES["llama-3.1-8b"]),
    # DeepSeek-R1-Distill-Qwen-1.5B: Qwen2.5-1.5B's widths with its own rope base (10000) and an untied LM head
    "r1-distill-qwen-1.5b": ("qwen2", {**QWEN2_SHAPES["qwen2.5-1.5b"], "rope_theta": 10_000.0,
                                       "tie_word_embeddings": False}),
    "moonlight-16b-a3b": ("deepseek_v3", DEEPSEEK_V3_SHAPES["moonlight-16b-a3b"]),
    "gpt-oss-20b": ("gpt_oss", GPT_OSS_SHAPES["gpt-oss-20b"]),
}  # fmt: skip


def _shaped(args):
    family, values = SHAPES[args.shape]
    drop = ("max_position_embeddings",) if args.vocab == "real" else ("vocab_size", "max_position_embeddings")
    shape = {k: v for k, v in values.items() if k not in drop}
    shape["max_position_embeddings"] = args.context
    if args.vocab == "real":  # Qwen3's config.json ids, which full_vocab.py's tokenizer gives the same tokens
        vocab = _full_vocab()
        shape.update(bos_token_id=vocab.BPE_VOCAB, eos_token_id=vocab.BPE_VOCAB + 2)
    if args.layers_given:
        shape["num_hidden_layers"] = args.layers
    if family == "deepseek_v3":
        args.family = "deepseek_v3"
        args.experts, args.top_k = shape["n_routed_experts"], shape["num_experts_per_tok"]
        shape["first_k_dense_replace"] = min(shape["first_k_dense_replace"], shape["num_hidden_layers"] - 1)
        return tiny_deepseek_v3_config(**shape)
    if family == "qwen3_moe":
        args.experts, args.top_k = shape["num_experts"], shape["num_experts_per_tok"]
        return tiny_qwen3_moe_config(**shape)
    if family == "gpt_oss":
        args.experts, args.top_k = shape["num_local_experts"], shape["num_experts_per_tok"]
        return tiny_gpt_oss_config(**shape)
    return tiny_config(family, **shape)


def _write(args, cfg) -> None:
    if cfg.tie_word_embeddings:
        # tied: the embedding is the LM head, so N(0, 1) embeddings give logits of std sqrt(hidden) (45 at 2048) and a
        # one-hot policy (entropy 0, every logprob 0: no mismatch can show); std 1/sqrt(hidden) gives logits of std ~1
        path = Path(args.out)
        save_checkpoint(random_model(cfg, args.seed, embed_std=cfg.hidden_size**-0.5), path)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the byte tokenizer every tiny checkpoint has
            shutil.copyfile(default_checkpoint("qwen3") / name, path / name)
    else:
        path = make_tiny_checkpoint(args.out, cfg, seed=args.seed)
    if args.family == "deepseek_v3":
        _deepseek_tokenizer(path, cfg)
    if args.vocab == "real":
        _full_vocab().write_tokenizer(path, cfg.vocab_size)
    tok_cfg = path / "tokenizer_config.json"
    meta = json.loads(tok_cfg.read_text())
    template = DEEPSEEK_CHAT_TEMPLATE if args.family == "deepseek_v3" else CHAT_TEMPLATE
    meta.update(chat_template=template, model_max_length=cfg.max_position_embeddings)
    tok_cfg.write_text(json.dumps(meta, indent=2) + "\n")
    moe = f", {args.experts} experts top-{args.top_k}" if args.experts else ""
    print(
        f"wrote {path} ({args.shape or args.family}, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers{moe}, "
        f"vocab {cfg.vocab_size})"
    )


def _full_vocab():
    """full_vocab.py beside this file, loaded by path: this file also runs loaded by path (the tests), off sys.path."""
    spec = importlib.util.spec_from_file_location("full_vocab", Path(__file__).with_name("full_vocab.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _deepseek_tokenizer(path: Path, cfg) -> None:
    """The byte tokenizer with DeepSeek's four special tokens added (in the vocabulary's padding slots), BOS/EOS set
    to DeepSeek's and the config's ids to match."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens(
        {"bos_token": DS_BOS, "eos_token": DS_EOS, "additional_special_tokens": [DS_USER, DS_ASSISTANT]}
    )
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"{len(tok)} tokens do not fit the vocabulary of {cfg.vocab_size}")
    tok.save_pretrained(str(path))
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.exists():
            c = json.loads(f.read_text())
            c.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
            f.write_text(json.dumps(c, indent=2) + "\n")


def _deepseek_v3(args):
    experts = args.experts
    if experts % 4 or args.top_k > experts // 2:
        raise ValueError(f"--family deepseek_v3: --experts must be a multiple of 4 (4 groups, 2 kept) and >= 2 * "
                         f"--top-k; got {experts} and {args.top_k}")  # fmt: skip
    heads = args.hidden // 64
    return tiny_deepseek_v3_config(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers, num_attention_heads=heads, q_lora_rank=None, kv_lora_rank=args.hidden // 2,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=experts,
        num_experts_per_tok=args.top_k, n_group=4, topk_group=2, first_k_dense_replace=min(1, args.layers - 1),
        max_position_embeddings=1024,
    )  # fmt: skip


if __name__ == "__main__":
    main()
