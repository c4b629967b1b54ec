"""silu_and_mul: ``silu(gate) * up`` in fp32, cast once.

torch's CPU ``silu``/``sigmoid`` are not position-invariant (measured on torch 2.13: the same value gives a different
result in the vector body and in the scalar tail of a launch), so the invariant path builds silu from exp and
division, whose results were measured position-invariant (see tests/test_activation.py). On CUDA the ``invariant``
backend runs the same formula as a Triton kernel (``triton_ops/activation.py``, with a backward). The ``fast`` backend
is the mismatch baseline as transformers runs it: ``F.silu(gate) * up`` in the input dtype (two roundings in bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import portable_math as pm
from ._backend import check_float, get_backend, invariant_device_check
from .triton_ops import use_triton


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_float("silu_and_mul", "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if get_backend("activation") == "fast":
        # as transformers and vLLM run it: silu rounded to the input dtype, then the product rounded again
        return F.silu(gate) * up
    if use_triton(gate, up):
        from .triton_ops.activation import triton_silu_and_mul

        return triton_silu_and_mul(gate, up)
    invariant_device_check("silu_and_mul", gate, up)
    g = gate.float()
    return (g / (1.0 + pm.exp(-g)) * up.float()).to(gate.dtype)
