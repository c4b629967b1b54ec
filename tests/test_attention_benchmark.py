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
