"""Logits, log-softmax and per-token logprobs / entropy from final hidden states.

This is the one place where the engine's sampler and the trainer's loss read the model's distribution, so both
call these functions: final RMSNorm -> lm_head (fp32 output) -> ``logits / temperature`` (fp32 division, the way the
trainer applies temperature) -> log_softmax in fp32 over the full vocabulary.

Invariance (``invariant`` backend): every reduction over the vocabulary (max, sum of exp, entropy) is fixed-order per
row, so a row's logprobs do not depend on the other rows, on the token chunk size, or on whether temperature came as
a scalar or a per-row tensor. ``logprobs_from_hidden`` processes tokens in chunks of ``chunk_size`` so the full
[tokens, vocab] fp32 logits never exist at once; the chunk size does not change any value.

On CUDA (``invariant`` backend) these run as Triton kernels (``triton_ops/``): ``compute_logits`` is the Triton
rms_norm then :func:`linear` (the invariant matmul) in fp32; ``log_softmax`` is a Triton row kernel with a fixed
vocabulary-block order; ``logprobs_from_hidden`` is the Triton rms_norm then one fused kernel (lm_head + temperature +
online log-sum-exp + entropy + target gather; ``triton_ops/logprobs.py``) that never materialises the logits, with a
deterministic backward. That fused kernel is the single source of truth for logprobs on GPU: the engine reports a
sampled token's logprob by calling ``logprobs_from_hidden`` on that token's hidden row, exactly as the trainer does.
On CUDA ``chunk_size`` is validated but not needed (the fused kernel streams the vocabulary); values never depend on it.

The engine's draw from the same distribution (``sample_from_hidden``) is in ``sample.py``.
"""

from __future__ import annotations

import torch

from . import portable_math as pm
from ._backend import get_backend, invariant_device_check, use_backend
from ._reduce import tree_sum
from .linear import linear
from .rms_norm import rms_norm
from .triton_ops import use_triton


def compute_logits(
    hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, lm_head_weight: torch.Tensor
) -> torch.Tensor:
    """Final norm then lm_head: ``hidden [T, H]`` -> fp32 logits ``[T, V]``.

    The final norm belongs to the ``rms_norm`` op family, the lm_head matmul to ``logprobs`` (not ``linear``).
    """
    normed = rms_norm(hidden, norm_weight, eps)
    with use_backend({"linear": get_backend("logprobs")}):
        return linear(normed, lm_head_weight, out_dtype=torch.float32)


def _temperature_column(temperature, rows: int) -> torch.Tensor:
    # checked where the values are: a host tensor or float costs no device sync (the engine passes host tensors;
    # every kernel moves the column to its device)
    t = torch.as_tensor(temperature, dtype=torch.float32)
    if t.dim() == 0:
        t = t.expand(rows)
    if t.shape != (rows,):
        raise ValueError(f"temperature must be a scalar or have one value per row ({rows}); got {tuple(t.shape)}")
    # a CUDA graph capture cannot read the device: it skips the check (the engine's draw graph reads temperatures
    # from its static buffers, which it fills with checked values), as vk.tensor_range's callers do
    capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and bool((t <= 0).any()):
        raise ValueError(f"temperature must be > 0 for logprobs; got {t.min().item()}")
    return t.reshape(rows, 1)


def log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """fp32 ``log_softmax(logits / temperature)`` over the last dim; ``temperature`` scalar or one per row."""
    if logits.dtype != torch.float32:
        raise TypeError(f"log_softmax: logits must be float32, got {logits.dtype}")
    temps = _temperature_column(temperature, logits.shape[0]).to(logits.device)
    if get_backend("logprobs") == "invariant" and use_triton(logits):
        from .triton_ops.logprobs import triton_log_softmax

        return triton_log_softmax(logits, temps.squeeze(1))
    z = logits / temps
    if get_backend("logprobs") == "fast":
        return torch.log_softmax(z, dim=-1)
    invariant_device_check("log_softmax", logits)
    shifted = z - z.amax(dim=-1, keepdim=True)
    lse = pm.log(tree_sum(pm.exp(shifted), dim=-1))
    return shifted - lse.unsqueeze(-1)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` per row, fixed-order."""
    fast = get_backend("logprobs") == "fast"
    p = torch.exp(logp) if fast else pm.exp(logp)
    terms = torch.where(p > 0, p * logp, 0.0)
    if fast:
        return -terms.sum(-1)
    return -tree_sum(terms, dim=-1)


def logprobs_from_hidden(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of ``targets [T]`` under each row of ``hidden [T, H]`` (and the entropy if asked), fp32.

    Works through ``chunk_size`` tokens at a time; the result does not depend on ``chunk_size``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = hidden.shape[0]
    if targets.shape != (n,):
        raise ValueError(f"targets must have shape [{n}] to match hidden; got {tuple(targets.shape)}")
    vocab = lm_head_weight.shape[0]
    if n:
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one host sync for both bounds
        if lo < 0 or hi >= vocab:
            raise ValueError(f"target token id out of range [0, {vocab}): min {lo}, max {hi}")
    temps = _temperature_column(temperature, n).squeeze(1)
    if get_backend("logprobs") == "invariant" and use_triton(hidden, lm_head_weight):
        from .triton_ops.logprobs import triton_logprobs

        if hidden.dim() != 2:
            raise ValueError(f"logprobs_from_hidden: hidden must be [T, H]; got shape {tuple(hidden.shape)}")
        normed = rms_norm(hidden, norm_weight, eps)
        return triton_logprobs(normed, lm_head_weight, targets, temps, with_entropy)
    out = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        logp = log_softmax(compute_logits(hidden[s:e], norm_weight, eps, lm_head_weight), temps[s:e])
        out[s:e] = logp.gather(1, targets[s:e].long().unsqueeze(1)).squeeze(1)
        if ent is not None:
            ent[s:e] = entropy_from_logprobs(logp)
    return out, ent
