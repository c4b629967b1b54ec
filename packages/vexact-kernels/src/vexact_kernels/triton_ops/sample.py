"""The draw of the ``invariant`` backend on CUDA: tokens drawn with Gumbel-max noise (``gumbel.py``).

:func:`triton_sample_logprobs` is the fused draw: the noise first (``gumbel._gumbel_noise_kernel``), then the fused
logprobs kernel in its sampling form (``logprobs.py``), one pass over the lm_head for the token and its logprob, which
is bitwise the scoring form's logprob of that token. :func:`triton_gumbel_argmax` draws from logits computed elsewhere
(the ``fast`` backend's), with the same noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv
from .gumbel import best_column, gumbel_scores, seed_keys
from .logprobs import _fwd, _operands, rows_on
from .rms_norm import aligned_rows

# The draw's noise is drawn ahead of the fused kernel into a [rows, V] fp32 buffer (``gumbel._gumbel_noise_kernel``):
# rows per fused launch, which bounds that buffer (155 MB at V = 151936). Speed and memory only: a row's draw is the
# same for any split of the rows.
SAMPLE_CHUNK_ROWS = 256
GUMBEL_BLOCK = 4096


def triton_sample_logprobs(
    normed: torch.Tensor, weight: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw a token per row of ``normed [T, H] @ weight[V, H].T / temps [T]`` with the row's 64-bit ``seeds [T]``
    (Gumbel-max, ``gumbel.gumbel_noise_tile``) and return ``(tokens [T] int64, logprobs [T] fp32)`` in one pass over
    the vocabulary. The noise is drawn first (``gumbel._gumbel_noise_kernel``, ``[rows, V]`` fp32,
    ``SAMPLE_CHUNK_ROWS`` rows a launch); the logprob is bitwise ``logprobs.triton_logprobs`` of the drawn token
    (same split kernel, same fold). A tile whose logits, plus the largest noise (``GUMBEL_NOISE_MAX``), fall below
    every row's best score so far in its split does not read its noise: it could not change a draw, so the tokens
    are those of the unskipped kernel. At small T (``SAMPLE_DRAW_ROWS``) only the real rows' part of the row block
    is drawn: the same tokens and bits."""
    if weight.dim() == 2 and weight.shape[0] >= 2**31:
        raise ValueError(f"sample: vocabulary of {weight.shape[0]} does not fit 32-bit column indices")
    normed, weight, temps, seeds = _operands("sample", normed, weight, temps, seeds)
    if normed.shape[0] <= SAMPLE_CHUNK_ROWS:
        lp, _, _, _, tokens = _fwd(normed, weight, None, temps, seeds)
        return tokens, lp
    parts = [_fwd(normed[i : i + SAMPLE_CHUNK_ROWS], weight, None, temps[i : i + SAMPLE_CHUNK_ROWS],
                  seeds[i : i + SAMPLE_CHUNK_ROWS]) for i in range(0, normed.shape[0], SAMPLE_CHUNK_ROWS)]  # fmt: skip
    return torch.cat([p[4] for p in parts]), torch.cat([p[0] for p in parts])


@triton.jit
def _gumbel_argmax_kernel(x_ptr, temp_ptr, seed_ptr, best_ptr, idx_ptr, V, n_chunks, BLOCK: tl.constexpr):
    """One row's chunk of ``BLOCK`` columns of fp32 logits: the best ``gumbel_scores`` of ``logits / temp`` and its
    first column."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < V
    temp = tl.load(temp_ptr + row)
    key_lo, key_hi = seed_keys(seed_ptr, row)
    z = tl.div_rn(tl.load(x_ptr + row * V + cols, mask=cmask, other=0.0), temp)
    score = tl.where(cmask[None, :], gumbel_scores(z[None, :], chunk * BLOCK, key_lo, key_hi, BLOCK), float("-inf"))
    best, idx = best_column(score, cols, V)
    out = row * n_chunks + chunk + tl.arange(0, 1)
    tl.store(best_ptr + out, best)
    tl.store(idx_ptr + out, idx.to(tl.int64))


def triton_gumbel_argmax(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Tokens ``[T]`` drawn from fp32 ``logits [T, V] / temps`` with the Gumbel-max noise of the fused draw (the
    draw of backends whose logits come from elsewhere, e.g. ``fast``); the first index among equal scores."""
    logits = aligned_rows(logits)
    temps = rows_on(temps, logits.device, torch.float32)
    seeds = rows_on(seeds, logits.device, torch.int64)
    t, v = logits.shape
    n_chunks = cdiv(v, GUMBEL_BLOCK)
    best = torch.empty(t, n_chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(t, n_chunks, dtype=torch.int64, device=logits.device)
    if t == 0:
        return idx[:, 0]
    _gumbel_argmax_kernel[(t, n_chunks)](logits, temps, seeds, best, idx, v, n_chunks, BLOCK=GUMBEL_BLOCK, num_warps=8)
    return idx.gather(1, torch.argmax(best, dim=1, keepdim=True)).squeeze(1)  # argmax: the first chunk on a tie
