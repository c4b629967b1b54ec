"""The committed tiny checkpoints: reproducible from their recipe, and the variants shaped as the golden contracts
need them (``TINY_VARIANTS``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from vexact_models import (
    TINY_CHECKPOINTS,
    TINY_VARIANTS,
    default_checkpoint,
    load_config,
    tiny_checkpoint_config,
    write_tiny_checkpoint,
)


@pytest.mark.parametrize("name", TINY_CHECKPOINTS)
def test_committed_weights_are_the_recipe(tmp_path, name):
    """``scripts/make_tiny_checkpoint.py`` would write the committed tensors again, bit for bit."""
    committed = load_file(str(default_checkpoint(name) / "model.safetensors"))
    written = load_file(str(write_tiny_checkpoint(name, tmp_path) / "model.safetensors"))
    assert sorted(committed) == sorted(written)
    assert all(torch.equal(committed[k], written[k]) and committed[k].dtype == written[k].dtype for k in committed)


@pytest.mark.parametrize("name", TINY_VARIANTS)
def test_committed_config_is_the_recipe(name):
    assert load_config(default_checkpoint(name)) == tiny_checkpoint_config(name)


def test_variants_make_the_promised_orders_matter():
    from vexact_kernels.attention import fa4_takes

    top8, raw = (load_config(default_checkpoint(n)) for n in ("qwen3_moe_top8", "qwen3_moe_top8_raw"))
    assert top8.num_experts_per_tok >= 4 and raw.num_experts_per_tok >= 4
    assert top8.norm_topk_prob and not raw.norm_topk_prob
    ds = load_config(default_checkpoint("deepseek_v3_top6"))
    assert ds.num_experts_per_tok >= 4 and ds.n_shared_experts >= 1
    assert ds.n_group > 1 and ds.topk_group < ds.n_group  # group-limited routing decides which experts can win
    hd = load_config(default_checkpoint("qwen3_hd64"))
    assert hd.head_dim == 64 and fa4_takes(hd.head_dim, hd.head_dim)


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="no committed tiny checkpoint 'qwen3_top3'"):
        default_checkpoint("qwen3_top3")
    with pytest.raises(ValueError, match="no tiny checkpoint 'x'"):
        tiny_checkpoint_config("x")
