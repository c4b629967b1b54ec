"""What the dense families add to the shared decoder: rope scaling (default, linear, llama3, dynamic) against
transformers, biases, the sliding-window refusal, and loading what transformers' ``save_pretrained`` writes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import vexact_kernels as vk
from vexact_models import (
    AttentionMetadata,
    expected_tensors,
    load_model,
    make_tiny_checkpoint,
    random_model,
    tiny_config,
)
from vexact_models.layers.rotary import rope_tables

transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")

FAMILIES = ["qwen3", "llama", "qwen2", "mistral"]
HF_CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "mistral": "MistralForCausalLM"}  # fmt: skip


def _max_logprob_error(path, cfg=None, n: int = 200) -> float:
    """fp32 on both sides: max |delta logprob| between our model and transformers' on one sequence of ``n``."""
    ours = load_model(path, dtype=torch.float32)
    if cfg is not None:  # our model built from another config than the checkpoint's (to show the check can fail)
        wrong = random_model(dataclasses.replace(cfg, torch_dtype="float32"))
        wrong.load_state_dict(ours.state_dict())
        ours = wrong
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, 272, (n,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = torch.log_softmax(ours.logits(ours(ids, torch.arange(n), AttentionMetadata.packed([n]))), -1)
        ref = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)
    return (mine - ref).abs().max().item()


VARIANTS = {
    "llama-linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama-dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    "llama-biases-untied": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rope_types_and_biases_match_transformers(tmp_path, variant):
    """The committed checkpoints cover default rope (qwen3, qwen2, mistral) and llama3 (llama) in the contracts;
    these are the other rope types and Llama's optional biases."""
    path = make_tiny_checkpoint(tmp_path, tiny_config("llama", **VARIANTS[variant]), seed=4, tokenizer=False)
    assert _max_logprob_error(path) < 1e-4


def test_parity_check_fails_on_a_wrong_rope():
    """The parity check can fail: the tiny Llama with the default rope instead of its llama3 scaling."""
    from vexact_models import default_checkpoint

    path = default_checkpoint("llama")
    assert _max_logprob_error(path) < 1e-4
    assert _max_logprob_error(path, cfg=tiny_config("llama", rope_scaling=None)) > 1e-2


def test_rope_tables():
    """Default (and dynamic, which only rescales beyond max_position_embeddings) is vexact-kernels' table bit for
    bit; llama3 keeps the high frequencies, divides the low ones by factor and blends the band between."""
    cos, sin = vk.rope_cos_sin(16, 512, 1e4)
    for scaling in (None, {"rope_type": "dynamic", "factor": 4.0}):
        c, s = rope_tables(16, 512, 1e4, scaling)
        assert torch.equal(c, cos) and torch.equal(s, sin)
    llama3 = tiny_config("llama").rope_scaling
    c, _ = rope_tables(16, 512, 1e4, llama3)
    assert torch.equal(c[:, 0], cos[:, 0])  # wavelength 2*pi < 16: unchanged
    linear, _ = rope_tables(16, 512, 1e4, {"rope_type": "linear", "factor": 8.0})
    assert torch.equal(c[:, -1], linear[:, -1])  # the longest wavelength > 64: divided by factor
    assert not torch.equal(c, cos) and not torch.equal(c, linear)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loads_what_transformers_save_pretrained_writes(tmp_path, family, tied):
    """A checkpoint written by transformers' own class of the family loads unchanged, every tensor equal."""
    cfg = tiny_config(family, tie_word_embeddings=tied, torch_dtype="float32")
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    torch.manual_seed(0)
    hf = getattr(transformers, HF_CLASSES[family])(hf_cfg)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert type(ours).__name__ == HF_CLASSES[family] and ours.config == cfg
    theirs = hf.state_dict()
    for name, t in expected_tensors(ours, remove_duplicate=False).items():
        assert torch.equal(t, theirs[name]), name


def test_sliding_window_that_cannot_bind_runs_and_one_that_binds_is_refused():
    """Mistral-7B-v0.1 sets a 4096 window: sequences up to the window are exactly full attention and run; a longer
    one is refused naming sliding_window, in both drivers (the engine also refuses such a max_model_len at
    construction: vexact-engine's test_bad_input)."""
    model = random_model(tiny_config("mistral", sliding_window=8, num_hidden_layers=1))
    assert torch.isfinite(model(torch.arange(8), torch.arange(8), AttentionMetadata.packed([8])).float()).all()
    with pytest.raises(ValueError, match="position 8 >= sliding_window 8: sliding-window attention is not implemented"):
        model(torch.arange(9), torch.arange(9), AttentionMetadata.packed([9]))
