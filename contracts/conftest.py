import pytest
import torch

from contracts.harness import gpu_target, skip_on_gpu
from vexact_models import default_checkpoint, load_model


@pytest.fixture(scope="session")
def target(request) -> str:
    t = request.config.getoption("--target")
    if t != "cpu":
        if not torch.cuda.is_available():
            pytest.fail(f"contract target {t!r} needs a CUDA device; none is visible")
        if gpu_target() != t:
            pytest.fail(f"contract target {t!r} but the device is {torch.cuda.get_device_name()!r}")
    return t


@pytest.fixture(scope="session")
def device(target) -> str:
    return "cpu" if target == "cpu" else "cuda"


@pytest.fixture(scope="session")
def tiny_model(device):
    """The committed tiny Qwen3 checkpoint (bf16), shared read-only by the contracts."""
    return load_model(default_checkpoint(), device=device)


@pytest.fixture(scope="session")
def tiny_moe_model(device):
    """The committed tiny Qwen3-MoE checkpoint (bf16): 3 layers, the middle one dense, 8 experts, top-2."""
    return load_model(default_checkpoint("qwen3_moe"), device=device)


@pytest.fixture(scope="session")
def family_model(device):
    """``family_model(family)``: the committed tiny checkpoint of a family (bf16), loaded once per test run. A family
    the GPU targets do not run yet (``harness.GPU_NOT_YET``) skips the test there, saying why."""
    loaded = {}

    def get(family: str):
        skip_on_gpu(family, device)
        if family not in loaded:
            loaded[family] = load_model(default_checkpoint(family), device=device)
        return loaded[family]

    return get
