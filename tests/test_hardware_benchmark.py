"""benchmarks/hardware.py on CPU: the data-sheet peak found by device name, the MFU arithmetic, and the measurements'
smoke sizes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import hardware  # noqa: E402


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H800", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_datasheet_peak_by_device_name(name, peak):
    assert hardware.datasheet_peak(name) == peak


def test_no_datasheet_peak_on_cpu():
    assert hardware.device_datasheet_peak("cpu") is None


def test_mfu_is_flops_over_time_over_peak():
    assert hardware.mfu(989e12, 2.0, 989e12) == pytest.approx(0.5)
    assert hardware.mfu(6e12, 0.01, 1.2e15) == pytest.approx(0.5)
    assert hardware.mfu(1e12, 1.0, None) is None
    assert math.isnan(hardware.mfu(1e12, 1.0, float("nan")))


def test_measurements_run_on_cpu():
    assert hardware.copy_bandwidth("cpu") > 0
    assert hardware.matmul_peak("cpu") > 0
