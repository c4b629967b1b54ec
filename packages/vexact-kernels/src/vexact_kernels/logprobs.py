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

``sample_from_hidden`` is the engine's draw for rows without top-k / top-p: Gumbel-max over ``logits / T`` with
noise from Philox-4x32-10 keyed by the row's 64-bit seed, one call per four vocabulary columns (counter
``column // 4``, output word ``column % 4``: :func:`gumbel_uniform`), so a row's token depends on its logits, seed
and nothing else. On CUDA the noise is drawn by an elementwise kernel into a ``[rows, V]`` fp32 buffer (at most
``SAMPLE_CHUNK_ROWS`` rows a launch), then the fused logprobs kernel in its sampling form reads it (one pass over the
lm_head for the draw and the drawn token's logprob, which is bitwise the trainer's); elsewhere the logits, the same
noise bit for bit, and :func:`logprobs_from_hidden`.
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

    The torch twin of the GPU kernel's draw (``triton_ops/logprobs.py`` ``gumbel_scores``, Triton's ``philox_impl``):
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
        from .triton_ops.logprobs import triton_sample_logprobs

        normed = rms_norm(hidden, norm_weight, eps)
        return triton_sample_logprobs(normed, lm_head_weight, temps, seeds)
    logits = compute_logits(hidden, norm_weight, eps, lm_head_weight)
    if use_triton(logits):  # e.g. the fast backend on CUDA: the same noise from a Triton kernel, no [T, V] int64
        from .triton_ops.logprobs import triton_gumbel_argmax

        tokens = triton_gumbel_argmax(logits, temps, seeds)
    else:
        u = gumbel_uniform(seeds.to(logits.device), logits.shape[1])
        tokens = torch.argmax(logits / temps.to(logits.device)[:, None] - pm.log(-pm.log(u)), dim=-1)
    logprobs, _ = logprobs_from_hidden(hidden, norm_weight, eps, lm_head_weight, tokens, temps)
    return tokens, logprobs


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
