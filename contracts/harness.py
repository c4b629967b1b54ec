"""Reusable checks, so each contract can also be shown failing on a deliberately perturbed op."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vexact_models import (
    DEEPSEEK_V3_SHAPES,
    GPT_OSS_SHAPES,
    LLAMA_SHAPES,
    MISTRAL_SHAPES,
    QWEN2_SHAPES,
    QWEN3_MOE_SHAPES,
    QWEN3_SHAPES,
)

# Families a GPU target does not run yet, per target, with the reason: their contracts are skipped there (saying so)
# and their golden fixtures for that target are not recorded; the cpu target runs every family in full. A test that
# cannot run on a GPU for a reason of its own says so itself.
GPU_NOT_YET = {
    "gpt_oss": {
        "h100": "its kernels, contracts and h200 fixture pass on an H200; not yet run on an H100, so its h100 "
        "fixture is not recorded",
    },
}

# the GPU target a CUDA device stands for, from its name
GPU_NAMES = {"h100": "H100", "h200": "H200", "b200": "B200"}


def gpu_target() -> str | None:
    """The GPU target (``h100``, ``h200``, ``b200``) of the current CUDA device, ``None`` for any other device."""
    name = torch.cuda.get_device_name()
    return next((t for t, n in GPU_NAMES.items() if n in name), None)


def not_yet_reason(family: str, target: str) -> str | None:
    """Why ``family`` does not run on GPU target ``target`` yet (:data:`GPU_NOT_YET`), ``None`` where it does."""
    return None if target == "cpu" else GPU_NOT_YET.get(family, {}).get(target)


def skip_on_gpu(family: str, device: str) -> None:
    """Skip the calling test, with the reason, for a family this GPU's target does not run yet (:data:`GPU_NOT_YET`)."""
    import pytest

    if device == "cpu":
        return
    target = gpu_target()
    reason = not_yet_reason(family, target) if target else None
    if reason:
        pytest.skip(f"{family} on {target}: {reason}")


def row_invariance_violations(
    op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, subsets: list[list[int]]
) -> list[int]:
    """Rows whose result differs (bitwise) between the full batch and each sub-batch (incl. each row alone)."""
    full = op(x)
    bad = set()
    for rows in [[i] for i in range(min(len(x), 8))] + subsets:
        part = op(x[rows])
        for j, r in enumerate(rows):
            if not torch.equal(part[j], full[r]):
                bad.add(r)
    return sorted(bad)


def logprob_mismatches(engine_outputs, trainer_logprobs) -> list[tuple[str, int]]:
    """(request_id, n_mismatched_tokens) for every request whose logprobs are not torch.equal."""
    out = []
    for o, lp in zip(engine_outputs, trainer_logprobs, strict=True):
        lp = lp.cpu()
        if not torch.equal(o.logprobs, lp):
            n = o.logprobs.numel() if o.logprobs.shape != lp.shape else int((o.logprobs != lp).sum())
            out.append((o.request_id, n))
    return out


# Real Qwen3 shapes (vexact_models.QWEN3_SHAPES), for the GPU-target contracts that run real-sized random models.
QWEN3_06B = QWEN3_SHAPES["qwen3-0.6b"]
QWEN3_17B = QWEN3_SHAPES["qwen3-1.7b"]
QWEN3_30B_A3B = QWEN3_MOE_SHAPES["qwen3-30b-a3b"]
# Moonlight-16B-A3B's real per-layer shapes, three layers (the first dense, as in the real model): the GPU-target
# DeepSeek-V3-family model.
MOONLIGHT_3L = {**DEEPSEEK_V3_SHAPES["moonlight-16b-a3b"], "num_hidden_layers": 3}
# gpt-oss-20b's real per-layer shapes, two layers (the first sliding, a window of 128; the second full): the GPU-target
# gpt-oss model, whose sequences outrun its window.
GPT_OSS_20B_2L = {**GPT_OSS_SHAPES["gpt-oss-20b"], "num_hidden_layers": 2}

# Real shapes of the other dense families, as (family, overrides of vexact_models.tiny_config(family)): head_dim 64
# and a tied 128k vocabulary (Llama-3.2-1B), q/k/v biases at hidden 3584 (Qwen2.5-7B), a 4096 window that the
# contracts' sequences fit in (Mistral-7B-v0.1).
DENSE_SHAPES = {
    "llama-3.2-1b": ("llama", LLAMA_SHAPES["llama-3.2-1b"]),
    "qwen2.5-7b": ("qwen2", QWEN2_SHAPES["qwen2.5-7b"]),
    "mistral-7b-v0.1": ("mistral", MISTRAL_SHAPES["mistral-7b-v0.1"]),
}
