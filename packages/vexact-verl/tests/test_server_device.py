"""A server or pipeline stage builds its engine on its worker's GPU, found by UUID (not by index)."""

from __future__ import annotations

import pytest
import torch

from vexact_verl import server


@pytest.fixture
def two_gpus(monkeypatch):
    """A process that sees both GPUs of a node (its CUDA started before CUDA_VISIBLE_DEVICES was set)."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr("vexact_models.device_uuid", lambda i: f"GPU-uuid-{i}")
    return chosen


def test_worker_device_is_the_gpu_with_the_workers_uuid(two_gpus):
    assert server._worker_device("GPU-uuid-1") == "cuda:1"
    assert server._worker_device(None) == "cuda:0"
    assert two_gpus == [1, 0]


def test_a_gpu_the_process_cannot_see_is_named(two_gpus):
    with pytest.raises(RuntimeError, match="GPU-uuid-7 is not among this process's GPUs"):
        server._worker_device("GPU-uuid-7")


def test_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert server._worker_device("GPU-uuid-1") == "cpu"
