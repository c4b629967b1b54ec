"""benchmarks/moe_train.py on CPU: the smoke run (tiny shapes of both families) writes its report, and the FLOP count
follows the docstring's formula."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vexact_models import random_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import moe_train  # noqa: E402


def test_flops_count_routed_experts_per_token():
    cfg = moe_train.shape_config("qwen3-30b-a3b", 2, tiny=True)
    model = random_model(cfg)
    flops, parts = moe_train.step_flops(model, [10, 6])
    h, i, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    assert parts["routed"] == 6 * 16 * cfg.num_hidden_layers * k * 3 * h * i
    d = cfg.head_dim
    attn_proj = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    assert parts["dense"] == 6 * 16 * cfg.num_hidden_layers * (attn_proj + cfg.num_experts * h)
    assert parts["lm_head"] == 6 * 16 * cfg.vocab_size * h
    assert parts["attention"] == 3.5 * 2 * cfg.num_attention_heads * 2 * d * (100 + 36)
    assert flops == sum(parts.values())


def test_moonlight_shape_is_the_published_one():
    cfg = moe_train.shape_config("moonlight-16b-a3b", 4, tiny=False)
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok) == (
        2048, 64, 1408, 6,
    )  # fmt: skip
    assert (cfg.n_shared_experts, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.num_hidden_layers) == (2, 512, None, 4)
    assert moe_train.attention_dims(cfg) == (16, 192, 128)


def test_cpu_smoke_writes_the_report(tmp_path):
    out = tmp_path / "moe-train.md"
    assert moe_train.main(["--device", "cpu", "--shape", "tiny", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Command: `python benchmarks/moe_train.py --device cpu --shape tiny" in text
    for shape in moe_train.SHAPES:
        assert f"## {shape}: 2 layers" in text
    assert text.count("| ours | `invariant` |") == 2 and text.count("| anchor | `fast` |") == 2
    assert text.count("ours / anchor tokens/s: **") == 2
    assert "per-expert F.linear loop (no torch._grouped_mm kernel on CPU)" in text
    assert text.count("### Where ours' step goes") == 2 and "| operator | calls / step |" in text
    assert text.count("FSDP2 reshard_after_forward on.") == 2


def test_reshard_after_forward_off_reaches_fsdp(tmp_path, monkeypatch):
    import vexact_trainer

    seen = []
    real = vexact_trainer.parallelize

    def spy(model, mesh=None, **kw):
        seen.append(kw.get("reshard_after_forward"))
        return real(model, mesh, **kw)

    monkeypatch.setattr(vexact_trainer, "parallelize", spy)
    out = tmp_path / "moe-train.md"
    argv = ["--device", "cpu", "--shape", "tiny", "--no-reshard-after-forward", "--rounds", "1", "--iters", "1",
            "--profile", "0", "--out", str(out)]  # fmt: skip
    assert moe_train.main(argv) == 0
    assert seen == [False] * len(moe_train.SHAPES)
    assert "FSDP2 reshard_after_forward off." in out.read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cpu", "--shape", "qwen3-30b-a3b"], "--device cpu runs only --shape tiny"),
        (["--device", "cpu", "--shape", "tiny", "--layers", "0"], "--layers must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        moe_train.parse_args(argv)
    assert message in capsys.readouterr().err
