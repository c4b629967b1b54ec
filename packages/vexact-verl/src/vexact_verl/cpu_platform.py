"""A CPU platform for verl 0.9.1, for CI and development machines without an accelerator.

verl 0.9.1 knows ``cuda``, ``npu`` and ``rocm`` and falls back to CUDA when none is present. This platform lets
verl's own trainer (Ray workers, FSDP engine, agent loop, rollout) run on CPU processes with gloo, so that a whole
verl GRPO run with the vexact rollout is exercised in CI on the tiny model. Select it with ``VERL_PLATFORM=cpu``
(:func:`vexact_verl.register` registers it in verl's ``PlatformRegistry``; verl reads the variable in each process).

verl places its workers on Ray's ``GPU`` resource (its resource-pool check counts GPUs). On CPU those are *declared*
slots: start Ray with ``+ray_kwargs.ray_init.num_gpus=N`` and each slot is one CPU process. Nothing here is used on a
machine with a GPU unless ``VERL_PLATFORM=cpu`` asks for it.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from verl.plugin.platform.platform_base import PlatformBase

PLATFORM_NAME = "cpu"


class CPUPlatform(PlatformBase):
    """verl's device abstraction for CPU processes: device ``cpu``, collectives on gloo."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu  # verl compares against torch.cpu to skip device memory statistics

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return False  # never auto-detected: only VERL_PLATFORM=cpu selects it, so GPU hosts are unaffected

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self):
        pass

    profiler_stop = profiler_start

    def ray_resource_name(self):
        return "GPU"  # the declared slots (see the module docstring)

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def register_platform() -> None:
    """Put :class:`CPUPlatform` in verl's ``PlatformRegistry`` as ``cpu`` (chosen only by ``VERL_PLATFORM=cpu``)."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(PLATFORM_NAME)(CPUPlatform)
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME:
        _dedupe_gloo_backend()
        _fill_device_module()


def _dedupe_gloo_backend() -> None:
    """verl asks for ``f"cpu:gloo,{device}:{backend}"``, which on this platform is ``cpu:gloo,cpu:gloo``, a string
    torch rejects (duplicate device type). Make ``init_process_group`` read it as plain ``gloo``. Only done when
    ``VERL_PLATFORM=cpu`` selects this platform."""
    init = torch.distributed.init_process_group
    if getattr(init, "_vexact_cpu", False):
        return

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") == "cpu:gloo,cpu:gloo":
            kwargs["backend"] = "gloo"
        return init(*args, **kwargs)

    init_process_group._vexact_cpu = True
    torch.distributed.init_process_group = init_process_group


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _fill_device_module() -> None:
    """verl calls CUDA-module functions on the platform's ``device_module`` (memory statistics, ``empty_cache``, RNG
    state, ...). ``torch.cpu`` lacks them; give it neutral ones (no device memory: 0 bytes, no-op frees, torch's own
    RNG state, host memory for ``mem_get_info``). verl keeps recognising ``torch.cpu`` by identity, so the module
    itself is kept."""

    def zero(*args, **kwargs):
        return 0

    def nothing(*args, **kwargs):
        return None

    lent = {
        "empty_cache": nothing,
        "ipc_collect": nothing,
        "reset_peak_memory_stats": nothing,
        "set_per_process_memory_fraction": nothing,
        "memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_allocated": zero,
        "max_memory_reserved": zero,
        "mem_get_info": lambda *a, **k: _host_memory(),
        "get_device_name": lambda *a, **k: "cpu",
        "get_rng_state": torch.get_rng_state,
        "set_rng_state": torch.set_rng_state,
    }
    for name, fn in lent.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
