"""benchmarks/norms_ab.py on CPU: another revision's ``triton_ops`` folder loads as a package of its own beside the
installed one, and its launches run (interpreted) and compare; the script refuses to run without a GPU."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from vexact_kernels.triton_ops import interpreting

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import norms_ab  # noqa: E402

TRITON_OPS = ROOT / "packages" / "vexact-kernels" / "src" / "vexact_kernels" / "triton_ops"


@pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")
def test_a_copied_revision_loads_apart_and_gives_the_same_bits(tmp_path, monkeypatch):
    base_dir = tmp_path / "triton_ops"
    shutil.copytree(TRITON_OPS, base_dir, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.delitem(sys.modules, "baseline_triton_ops", raising=False)
    monkeypatch.delitem(sys.modules, "baseline_triton_ops.rms_norm", raising=False)
    base = norms_ab.load_baseline(base_dir)
    assert base.__name__ == "baseline_triton_ops.rms_norm" and Path(base.__file__).parent == base_dir
    assert base is not norms_ab.current
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 96, generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).bfloat16()
    got, want = base._add_rms_norm(x, r, w, norms_ab.EPS), norms_ab.current._add_rms_norm(x, r, w, norms_ab.EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_refuses_without_a_gpu_or_without_the_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["norms_ab.py", "--baseline", str(tmp_path)])
    if not torch.cuda.is_available():
        assert norms_ab.main() == 2
        assert "needs a CUDA device" in capsys.readouterr().err
    else:
        assert norms_ab.main() == 2
        assert "no rms_norm.py there" in capsys.readouterr().err
