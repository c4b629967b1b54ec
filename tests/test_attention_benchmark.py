"""benchmarks/attention.py's shapes from the command line (page size, head counts, decode and prefill shapes), on CPU:
the benchmark itself needs a GPU."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture
def bench():
    import attention  # benchmarks/attention.py

    return importlib.reload(attention)  # configure() sets module globals: each test starts from the defaults


def test_shapes_come_from_the_command_line(bench):
    ap = bench.build_parser()
    argv = ["--page", "128", "--heads", "16:8", "--decode-batches", "1,64,256", "--decode-contexts", "512,1024",
            "--prefill", "4x4096,1x8192"]  # fmt: skip
    bench.configure(ap, ap.parse_args(argv))
    assert (bench.PAGE, bench.HQ, bench.HKV) == (128, 16, 8)
    assert bench.DECODE_BATCHES == [1, 64, 256] and bench.DECODE_CONTEXTS == [512, 1024]
    assert bench.PREFILL_SHAPES == [(4, 4096), (1, 8192)]
    fresh = bench.build_parser()
    bench.configure(fresh, fresh.parse_args(["--quick", "--page", "16"]))
    assert bench.DECODE_BATCHES == [1, 64] and bench.PREFILL_SHAPES == [(4, 4096), (32, 512)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--page", "0"], "--page: values must be positive"),
        (["--heads", "16"], "--heads: expected query heads:KV heads"),
        (["--heads", "16:6"], "16 query heads is not a multiple of 6 KV heads"),
        (["--page", "128", "--decode-contexts", "100,512"], r"\[100\] are not multiples of the page size 128"),
        (["--prefill", "4x"], "--prefill: expected integers separated by 'x'"),
    ],
)
def test_bad_shapes_are_refused_naming_them(bench, capsys, argv, message):
    ap = bench.build_parser()
    with pytest.raises(SystemExit):
        bench.configure(ap, ap.parse_args(argv))
    assert re.search(message, capsys.readouterr().err)


def test_rl_decode_sweep_covers_the_issue_shapes(bench):
    ad = bench.ad
    cases = ad.build_sweep(list(ad.LAYOUTS), ad.BATCHES, ad.CONTEXTS, 16)
    equal = [c for c in cases if not c.mixed]
    mixed = [c for c in cases if c.mixed]
    assert len(equal) == 3 * 7 * 6 and len(mixed) == 3 * 4 * 6  # mixed from batch 64: 64, 128, 256, 512
    assert {c.batch for c in mixed} == {64, 128, 256, 512}
    assert {c.heads for c in cases} == {(16, 8, 128), (32, 8, 128), (32, 4, 128)}
    assert len({c.key for c in cases}) == len(cases)
    case = ad.DecodeCase("8b", 256, 4096, True, 16)
    lengths = case.lengths()
    assert lengths == case.lengths() and len(lengths) == 256  # seeded by the case: the same in every process
    assert all(2048 <= n <= 4096 for n in lengths) and len(set(lengths)) > 1
    with pytest.raises(ValueError, match="unknown head layout '70b'"):
        ad.build_sweep(["70b"], [1], [512], 16)


def test_rl_decode_bytes(bench):
    ad = bench.ad
    case = ad.DecodeCase("1.7b", 4, 1024, False, 16)
    kv = 2 * 4 * 1024 * 8 * 128 * 2  # K and V, 4 sequences x 1024 tokens x 8 KV heads x 128, bf16
    assert ad.kv_bytes(case) == kv
    assert ad.call_bytes(case) == kv + 2 * 4 * 16 * 128 * 2  # q read, out written
    mixed = ad.DecodeCase("30b-a3b", 64, 1000, True, 128)
    assert ad.kv_bytes(mixed) == 2 * sum(mixed.lengths()) * 4 * 128 * 2
    assert ad.cache_bytes(mixed) == 2 * sum(-(-n // 128) for n in mixed.lengths()) * 128 * 4 * 128 * 2
    assert ad.fraction(case, 100.0, ad.call_bytes(case) / 100e-6) == pytest.approx(1.0)
    assert ad.too_big(ad.DecodeCase("8b", 512, 16384, False, 16), 16 * 2**30).startswith("skipped: 32.0 GiB")
    assert ad.too_big(case, 2**30) is None


def test_rl_decode_table_from_fake_timings(bench):
    ad = bench.ad
    cases = ad.build_sweep(["1.7b", "30b-a3b"], [1, 64], [1024], 16)
    copy_bw = 3.0e12
    results = {}
    for c in cases:
        t = ad.call_bytes(c) / (0.75 * copy_bw) * 1e6  # 0.75 of the copy bandwidth
        results[c.key] = {"vexact-triton": t, "vexact-fa4": "not installed (x)", "vllm-fa3": t / 2,
                          "vllm-fa3-bi": "n/a (RuntimeError)", "fa4": "not installed (x)"}  # fmt: skip
    lines = ad.decode_table(cases, results, copy_bw)
    text = "\n".join(lines)
    assert "### Qwen3-1.7B shape: 16 query heads, 8 KV heads, head_dim 128" in text
    assert "### Qwen3-30B-A3B shape: 32 query heads, 4 KV heads, head_dim 128" in text
    header = next(line for line in lines if line.startswith("| batch"))
    assert header.count("|") == 11 and "vLLM FA3 b-i" in header
    rows = [line for line in lines if line.startswith("| 64 | 1024 |")]
    assert len(rows) == 4 and any("[512, 1024]" in r for r in rows)  # equal and mixed, per layout
    for row in rows:
        cells = [x.strip() for x in row.strip("|").split("|")]
        assert len(cells) == 10
        assert cells[4].endswith(", 0.75") and cells[6].endswith(", 1.50")
        assert cells[5] == "not installed (x)" and cells[7] == "n/a (RuntimeError)" and cells[9] == "2.00"
    missing = ad.decode_table(cases[:1], {}, copy_bw)
    assert missing[-1].endswith("| - | - | - | - | - | - |")


def test_missing_peers_give_not_installed_cells(bench, monkeypatch, tmp_path):
    ad = bench.ad
    from vexact_kernels import fa4_attention

    monkeypatch.setattr(fa4_attention, "fa4_importable", lambda: (False, "no flash_attn.cute; install it"))
    case = ad.DecodeCase("8b", 1, 512, False, 16)
    fns = ad.vexact_fns(dict.fromkeys(("q", "kc", "vc", "bt", "ctx", "cu")), case)
    assert fns["vexact-fa4"] == fns["fa4"] == "not installed (no flash_attn.cute)"
    assert callable(fns["vexact-triton"])
    # vLLM's rows run in a subprocess; a site whose vLLM does not import gives every vLLM cell "not installed"
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise ImportError('staged without its kernels')\n")
    cases = [case, ad.DecodeCase("8b", 64, 512, True, 16)]
    res, version = ad.run_vllm(cases, str(site), 10.0, 2**30, 3, tmp_path)
    assert version.startswith("not installed (ImportError: staged without its kernels")
    assert set(res) == {c.key for c in cases}
    assert all(cell == version for row in res.values() for cell in row.values())
    assert set(res[case.key]) == set(ad.VLLM_IMPLS)


def test_rl_decode_flags(bench, capsys):
    ap = bench.build_parser()
    args = ap.parse_args(["--decode-only", "--rl-layouts", "1.7b,30b-a3b", "--rl-batches", "64,512",
                          "--rl-contexts", "1024", "--page", "128", "--vllm-site", "/nowhere"])  # fmt: skip
    bench.configure(ap, args)
    assert args.decode_only and args.vllm_site == "/nowhere" and bench.PAGE == 128
    assert (bench.RL_LAYOUTS, bench.RL_BATCHES, bench.RL_CONTEXTS) == (["1.7b", "30b-a3b"], [64, 512], [1024])
    fresh = bench.build_parser()
    bench.configure(fresh, fresh.parse_args(["--quick"]))
    assert (bench.RL_LAYOUTS, bench.RL_BATCHES, bench.RL_CONTEXTS) == (["8b"], [1, 64, 256], [1024, 4096])
    bad = bench.build_parser()
    with pytest.raises(SystemExit):
        bench.configure(bad, bad.parse_args(["--rl-layouts", "8b,70b"]))
    assert "--rl-layouts: unknown ['70b']" in capsys.readouterr().err


def test_rl_decode_inputs_page_every_sequence_apart(bench):
    ad = bench.ad
    case = ad.DecodeCase("30b-a3b", 64, 512, True, 16)
    x = ad.make_inputs(case, device="cpu")
    lengths = case.lengths()
    pages = [-(-n // 16) for n in lengths]
    assert x["q"].shape == (64, 32, 128) and x["kc"].shape == (sum(pages), 16, 4, 128) == x["vc"].shape
    assert x["bt"].shape == (64, 32) and x["ctx"].tolist() == lengths and x["max_ctx"] == max(lengths)
    assert x["cu"].tolist() == list(range(65))
    used = [p for b, n in enumerate(pages) for p in x["bt"][b, :n].tolist()]
    assert sorted(used) == list(range(sum(pages)))  # each page belongs to one sequence


def test_rl_decode_launch_variants(bench, capsys):
    """The launch-shape rows: every variant builds a call of the same kernel (interpreted here, where every shape
    gives the op's bits), and the table marks a variant whose output differs from the op's."""
    ad = bench.ad
    from vexact_kernels.triton_ops import interpreting

    if not interpreting():
        pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
    import torch

    case = ad.DecodeCase("1.7b", 2, 96, False, 16)
    x = ad.make_inputs(case, device="cpu")
    ref = ad.vexact_fns(x, case)["vexact-triton"]()()
    for name, build in ad.variant_fns(x, case, list(ad.VARIANTS)).items():
        assert torch.equal(build()(), ref), name
    copy_bw = 3.0e12
    t = ad.call_bytes(case) / (0.5 * copy_bw) * 1e6
    results = {
        case.key: {"op": t, "split": (t / 2, True), "m16": (t / 2, False), "s3": ("n/a (OutOfResources)", False)}
    }
    lines = ad.variant_table([case], results, ["split", "m16", "s3"], copy_bw)
    cells = [c.strip() for c in lines[-1].strip("|").split("|")]
    assert cells[4].endswith(", 0.50") and cells[5].endswith(", 1.00")
    assert cells[6].endswith("**bits differ**") and cells[7] == "n/a (OutOfResources)"
    ap = bench.build_parser()
    with pytest.raises(SystemExit):
        bench.configure(ap, ap.parse_args(["--variants", "split,m8"]))
    assert "--variants: unknown ['m8']" in capsys.readouterr().err
