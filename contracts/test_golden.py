"""Contract 3: the recorded golden logprobs of this target still reproduce, bit for bit.

A numerics change must come with a version bump and a re-recorded fixture, never silently; fixtures are per
target (bitwise holds within a target, not across CPU and GPU) and, on GPU targets, per attention implementation
(``fixtures/<target>-fa4/`` with ``VEXACT_ATTENTION=fa4``).
"""

from __future__ import annotations

import pytest
import torch

from contracts import golden
from contracts.harness import GPU_NOT_YET, not_yet_reason, skip_on_gpu


@pytest.fixture(scope="module", params=golden.FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def recorded(target, family):
    skip_on_gpu(family, "cpu" if target == "cpu" else "cuda")  # GPU fixtures not recorded (harness.GPU_NOT_YET)
    impl = golden.attention_impl(target, family)
    if impl not in (None, "triton") and not (golden.fixture_dir(target, family) / "golden.json").is_file():
        pytest.skip(
            f"no golden fixture yet for {target} with attention {impl!r} (each implementation has its own bits); "
            f"record it on the GPU: {golden.record_command(target, family)}"
        )
    return golden.load(target, family)


def test_fixture_belongs_to_this_target(recorded, target, family):
    tensors, meta = recorded
    assert meta["target"] == target, f"fixture in fixtures/{target} was recorded for {meta['target']}"
    assert meta["family"] == family
    if target != "cpu":  # fixtures from before the choice existed were all made with the Triton kernel
        made_with = meta.get("attention", "triton")
        assert made_with == golden.attention_impl(target, family), f"fixture was recorded with attention {made_with!r}"
    assert golden.tensors_sha256(tensors) == meta["sha256"], "fixture tensors do not match their recorded sha256"


def test_fixture_versions_match_packages(recorded):
    _, meta = recorded
    assert meta["versions"] == golden.versions(), (
        f"packages are at {golden.versions()} but the fixture was recorded with {meta['versions']}: a version bump "
        "needs a re-recorded fixture (python -m contracts.golden --target ...)"
    )


def test_golden_reproduces(recorded, device, family):
    tensors, meta = recorded
    now = golden.produce(device, family)
    for name, ref in tensors.items():
        assert torch.equal(now[name].cpu(), ref), (
            f"{name} no longer reproduces the golden fixture (recorded with torch {meta['torch']}, now "
            f"{torch.__version__}); if the change is intended, bump the package versions and re-record"
        )
    assert torch.equal(now["engine_logprobs"], now["trainer_logprobs"])


def test_hash_catches_a_one_bit_change(recorded):
    """The integrity check can fail: flip one bit of one logprob."""
    tensors, meta = recorded
    t = dict(tensors)
    lp = t["engine_logprobs"].clone()
    lp.view(torch.int32)[0] ^= 1
    t["engine_logprobs"] = lp
    assert golden.tensors_sha256(t) != meta["sha256"]


def test_fixture_dir_is_per_attention_impl(monkeypatch):
    """GPU fixtures of a non-default attention implementation live beside the default's, never over them."""
    monkeypatch.setattr(golden.vexact_kernels, "get_attention_impl", lambda: "fa4")
    # the families' tiny checkpoints have heads of 16, which FA4 does not take: they run (and are recorded with)
    # Triton; the variant with heads of 64 runs FA4
    assert golden._head_dims("qwen3") == (16, 16) and golden._head_dims("deepseek_v3") == (24, 16)
    assert golden._head_dims("qwen3_hd64") == (64, 64)
    fa4_dirs = {f for f in golden.FAMILIES if golden.fixture_dir("h100", f) == golden.FIXTURES / "h100-fa4" / f}
    assert fa4_dirs == {"qwen3_hd64"}
    assert all(golden.fixture_dir("h100", f) == golden.FIXTURES / "h100" / f for f in set(golden.FAMILIES) - fa4_dirs)
    assert golden.record_command("h200", "qwen3_moe") == "python -m contracts.golden --target h200 --family qwen3_moe"
    monkeypatch.setattr(golden, "_head_dims", lambda family: (128, 128))  # a checkpoint FA4 takes
    assert golden.fixture_dir("h100", "qwen3") == golden.FIXTURES / "h100-fa4" / "qwen3"
    assert golden.fixture_dir("cpu", "qwen3") == golden.FIXTURES / "cpu" / "qwen3"  # CPU: the reference, always
    assert golden.record_command("h200", "qwen3_moe").startswith("VEXACT_ATTENTION=fa4 python -m contracts.golden")
    monkeypatch.setattr(golden.vexact_kernels, "get_attention_impl", lambda: "triton")
    assert golden.fixture_dir("h100", "qwen3") == golden.FIXTURES / "h100" / "qwen3"


def test_gpu_not_yet_is_per_target():
    # a family left off one GPU target still runs on the others and always on cpu
    for family, targets in GPU_NOT_YET.items():
        for target in ("cpu", "h100", "h200", "b200"):
            reason = not_yet_reason(family, target)
            assert (reason is not None) == (target in targets), (family, target, reason)
    assert not_yet_reason("gpt_oss", "h200") is None
    assert not_yet_reason("qwen3", "h100") is None
