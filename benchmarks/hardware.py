"""What the benchmarks know about the device: its copy bandwidth, its bf16 matmul peak (data sheet and measured) and
the MFU that divides by one of them. Every script in ``benchmarks/`` imports this module (``import hardware``); run
as ``python benchmarks/X.py``, the script's folder is first on ``sys.path``.
"""

from __future__ import annotations

import statistics
import time

import torch

# Dense bf16 tensor-core peak from the vendors' data sheets, FLOP/s. Looked up by substring of the device name, first
# match wins, so "H100 PCIe" sits before "H100".
BF16_DATASHEET_PEAK = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
)
MATMUL_N = {"cuda": 8192, "cpu": 256}  # side of the square matmul whose speed is the measured peak
COPY_NUMEL = {"cuda": 1 << 30, "cpu": 1 << 24}  # int16 elements of the copied buffer: 2 GiB on a GPU


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def datasheet_peak(device_name: str) -> float | None:
    """Data-sheet dense bf16 FLOP/s of the device named ``device_name`` (``torch.cuda.get_device_name()``), None
    for a device not in ``BF16_DATASHEET_PEAK``."""
    return next((peak for key, peak in BF16_DATASHEET_PEAK if key in device_name), None)


def device_datasheet_peak(device: torch.device | str) -> float | None:
    """``datasheet_peak`` of ``device`` itself; None on a CPU."""
    device = torch.device(device)
    return datasheet_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def copy_bandwidth(device: torch.device | str) -> float:
    """Bytes/s of a device-to-device ``copy_`` of 2 GiB, counting bytes read and written: 20 back-to-back copies
    after 3 warm-up ones (32 MiB on a CPU, for smoke runs)."""
    device = torch.device(device)
    src = torch.empty(COPY_NUMEL[device.type], dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * src.element_size() * n / (time.perf_counter() - t)


def matmul_peak(device: torch.device | str) -> float:
    """Measured bf16 FLOP/s of one square ``torch.matmul`` (8192^3 on a GPU, 256^3 on a CPU): median of 10 after 3
    warm-up."""
    device = torch.device(device)
    n = MATMUL_N[device.type]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(10):
        _sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops`` done in ``seconds`` over ``peak`` FLOP/s (None when there is no peak)."""
    if peak is None:
        return None
    return flops / seconds / peak
