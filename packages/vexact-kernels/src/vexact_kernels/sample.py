"""The engine's draw from the distribution of :func:`~vexact_kernels.logprobs.logprobs_from_hidden`, for rows
without top-k / top-p.

``sample_from_hidden``: Gumbel-max over ``logits / T`` with noise from Philox-4x32-10 keyed by the row's 64-bit
seed, one call per four vocabulary columns (counter ``column // 4``, output word ``column % 4``:
:func:`gumbel_uniform`), so a row's token depends on its logits, seed and nothing else. On CUDA the noise is drawn
by an elementwise kernel into a ``[rows, V]`` fp32 buffer (``triton_ops/gumbel.py``, at most ``SAMPLE_CHUNK_ROWS``
rows a launch), then the fused logprobs kernel in its sampling form reads it (``triton_ops/sample.py``; one pass
over the lm_head for the draw and the drawn token's logprob, which is bitwise the trainer's); elsewhere the logits,
the same noise bit for bit, and :func:`logprobs_from_hidden`.
"""

from __future__ import annotations

import torch

from . import portable_math as pm
from ._backend import get_backend
from .logprobs import _temperature_column, compute_logits, logprobs_from_hidden
from .rms_norm import rms_norm
from .triton_ops import use_triton

PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def _mul_u32(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * x`` for a uint32 constant and uint32 values held in int64 (16-bit limbs:
    no intermediate leaves int64)."""
    t = a * (x & 0xFFFF)
    big = a * (x >> 16) + (t >> 16)
    return big >> 16, ((big & 0xFFFF) << 16) | (t & 0xFFFF)


def gumbel_uniform(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), fp32 ``[rows, vocab]``: Philox-4x32-10 keyed by each row's 64-bit seed (``seeds`` int64
    ``[rows]``); column ``c`` takes output word ``c % 4`` of counter ``(c // 4, 0, 0, 0)`` (one Philox call per four
    columns), its top 23 bits plus one half over 2**23.

    The torch twin of the GPU kernel's draw (``triton_ops/gumbel.py`` ``gumbel_noise_tile``, Triton's ``philox_impl``):
    the same bits on every device."""
    if seeds.dtype != torch.int64 or seeds.dim() != 1:
        raise TypeError(f"seeds must be int64 [rows]; got {seeds.dtype} {tuple(seeds.shape)}")
    if seeds.device.type == "cpu":
        words = torch.from_numpy(_philox_words_np(seeds.numpy(), vocab))
    else:
        words = _philox_words_torch(seeds, vocab)
    return ((words >> 9).to(torch.float32) + 0.5) * 2.0**-23  # exact in fp32: never 0 or 1


def _philox_words_torch(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """Philox-4x32-10 output words, int64 ``[rows, vocab]``: column ``c`` is word ``c % 4`` of counter
    ``(c // 4, 0, 0, 0)``; torch int64 ops on any device (16-bit limbs for the 32 x 32-bit products)."""
    k0 = (seeds & _U32)[:, None]
    k1 = ((seeds >> 32) & _U32)[:, None]
    n = -(-vocab // 4)
    c0 = torch.arange(n, dtype=torch.int64, device=seeds.device)[None, :].expand(seeds.shape[0], n)
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul_u32(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_u32(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _U32
        k1 = (k1 + PHILOX_KEY_B) & _U32
    return torch.stack((c0, c1, c2, c3), dim=-1).reshape(seeds.shape[0], 4 * n)[:, :vocab]


def _philox_words_np(seeds, vocab: int):
    """:func:`_philox_words_torch` with numpy's uint64 (a 32 x 32-bit product is exact there): the CPU path,
    about 16x faster than the torch limbs."""
    import numpy as np

    u64 = np.uint64
    s = seeds.astype(np.int64).view(np.uint64)
    k0 = (s & u64(_U32))[:, None]
    k1 = ((s >> u64(32)) & u64(_U32))[:, None]
    n = -(-vocab // 4)
    c0 = np.broadcast_to(np.arange(n, dtype=np.uint64)[None, :], (len(s), n))
    c1 = c2 = c3 = np.zeros_like(c0)
    for _ in range(10):
        p_b = u64(PHILOX_ROUND_B) * c2
        p_a = u64(PHILOX_ROUND_A) * c0
        c0, c1, c2, c3 = (p_b >> u64(32)) ^ c1 ^ k0, p_b & u64(_U32), (p_a >> u64(32)) ^ c3 ^ k1, p_a & u64(_U32)
        k0 = (k0 + u64(PHILOX_KEY_A)) & u64(_U32)
        k1 = (k1 + u64(PHILOX_KEY_B)) & u64(_U32)
    return np.stack((c0, c1, c2, c3), axis=-1).reshape(len(s), 4 * n)[:, :vocab].astype(np.int64)


def sample_from_hidden(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    lm_head_weight: torch.Tensor,
    temperature: float | torch.Tensor,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of pre-norm ``hidden [T, H]`` from ``softmax(logits / temperature)`` with the row's
    64-bit seed (``seeds`` int64 ``[T]``, e.g. one per request and token index); returns ``(tokens [T] int64,
    logprobs [T] fp32)``, the logprob being :func:`logprobs_from_hidden`'s for the drawn token, bit for bit.

    The draw is ``argmax(logits / T - log(-log(u)))`` (first index among equal scores), ``u`` from
    :func:`gumbel_uniform`: it depends on the row alone. No top-k / top-p: rows that restrict the draw go through
    :func:`compute_logits` and the engine's filter."""
    if hidden.dim() != 2:
        raise ValueError(f"sample_from_hidden: hidden must be [T, H]; got shape {tuple(hidden.shape)}")
    n = hidden.shape[0]
    if not isinstance(seeds, torch.Tensor) or seeds.dtype != torch.int64 or seeds.shape != (n,):
        got = f"{seeds.dtype} {tuple(seeds.shape)}" if isinstance(seeds, torch.Tensor) else type(seeds).__name__
        raise ValueError(f"sample_from_hidden: seeds must be int64 [{n}] (one per row); got {got}")
    temps = _temperature_column(temperature, n).squeeze(1)
    if get_backend("logprobs") == "invariant" and use_triton(hidden, lm_head_weight):
        from .triton_ops.sample import triton_sample_logprobs

        normed = rms_norm(hidden, norm_weight, eps)
        return triton_sample_logprobs(normed, lm_head_weight, temps, seeds)
    logits = compute_logits(hidden, norm_weight, eps, lm_head_weight)
    if use_triton(logits):  # e.g. the fast backend on CUDA: the same noise from a Triton kernel, no [T, V] int64
        from .triton_ops.sample import triton_gumbel_argmax

        tokens = triton_gumbel_argmax(logits, temps, seeds)
    else:
        u = gumbel_uniform(seeds.to(logits.device), logits.shape[1])
        tokens = torch.argmax(logits / temps.to(logits.device)[:, None] - pm.log(-pm.log(u)), dim=-1)
    logprobs, _ = logprobs_from_hidden(hidden, norm_weight, eps, lm_head_weight, tokens, temps)
    return tokens, logprobs
