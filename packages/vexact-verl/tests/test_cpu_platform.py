"""``vexact_verl.cpu_platform``: registered in verl's PlatformRegistry, chosen only by ``VERL_PLATFORM=cpu``."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

from verl.plugin.platform.platform_manager import PlatformRegistry  # noqa: E402

from vexact_verl import register  # noqa: E402
from vexact_verl.cpu_platform import CPUPlatform  # noqa: E402


def test_registered_but_never_auto_detected():
    register()
    assert PlatformRegistry.get("cpu") is CPUPlatform
    p = CPUPlatform()
    assert not p.is_platform_available(use_smi_check=True)  # a GPU host keeps verl's own detection
    assert (p.device_name, p.communication_backend_name(), p.ray_resource_name()) == ("cpu", "gloo", "GPU")


def test_verl_platform_cpu_selects_it_and_lends_what_verl_calls(subprocess_env):
    code = """
import torch, vexact_verl
from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
from verl.utils.distributed import initialize_global_process_group_ray
assert get_device_name() == "cpu" and get_nccl_backend() == "gloo"
dev = get_torch_device()
assert dev is torch.cpu
assert dev.memory_reserved() == 0 and dev.max_memory_allocated() == 0 and dev.empty_cache() is None
free, total = dev.mem_get_info()
assert 0 < free <= total
dev.set_rng_state(dev.get_rng_state())
import os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
initialize_global_process_group_ray()  # verl's "cpu:gloo,cpu:gloo"
assert torch.distributed.get_backend() == "gloo"
print("ok")
"""
    proc = _run(code, subprocess_env(VERL_PLATFORM="cpu"))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_without_the_variable_nothing_is_lent(subprocess_env):
    code = """
import torch, vexact_verl
assert not hasattr(torch.cpu, "memory_reserved")
assert not getattr(torch.distributed.init_process_group, "_vexact_cpu", False)
print("ok")
"""
    proc = _run(code, subprocess_env(VERL_PLATFORM=""))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
