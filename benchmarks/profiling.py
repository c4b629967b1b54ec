"""The GPU kernels of a profiled run, per step: the table the profiling scripts print
(``scripts/profiling/profile_decode.py``, ``benchmarks/trainer.py --profile``)."""

from __future__ import annotations

import statistics

import torch


def kernel_table(prof, steps: int, top: int = 18) -> list[str]:
    """Lines: kernels and kernel time per step, then the ``top`` kernels by time (count, us per step, us each), from a
    finished ``torch.profiler.profile`` over ``steps`` steps."""
    # GPU events that are kernels and copies, not the ranges user annotations (FSDP's, record_function's) draw there
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    gpu_us = sum(e.device_time for e in kernels) / steps
    lines = [f"  GPU kernels per step: {len(kernels) / steps:.0f}, {gpu_us / 1e3:.3f} ms of kernel time per step"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    lines.append(f"  {'kernel':<60} {'per step':>8} {'us/step':>9} {'us each':>8}")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(
            f"  {name[:60]:<60} {len(times) / steps:>8.0f} {sum(times) / steps:>9.1f} {statistics.mean(times):>8.2f}"
        )
    return lines
