"""Sampling: which draw each row of a step takes (:func:`sample_rows_on_device`), and seeded sampling from logits.

Rows that draw from the whole distribution (temperature > 0, no top-k / top-p: an RL rollout's rows) take the fused
draw (``vexact_kernels.sample_from_hidden``, through ``model.sample``: Gumbel-max with counter-based Philox noise
keyed by :func:`token_seed`, in one pass over the lm_head). Greedy rows, rows with top-k / top-p, and every row under
a mismatch injection take the logits and :func:`sample`.

The logprob reported for a token is ``log_softmax(logits / T)`` over the whole vocabulary (vexact-kernels, the
trainer's own function). Drawing: exponential-race sampling ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn from a
generator seeded by (request seed, token index), so a request's draw depends on nothing else in the batch and
survives preemption. top-k / top-p only zero out tokens that may not be drawn.

Everything runs on the logits' device: on CUDA each sampling row gets a CUDA ``torch.Generator`` seeded by
``token_seed`` (Philox; never a zero draw) and torch's ``exponential_``; on CPU a CPU one, whose float64 uniforms
(integer words scaled exactly) become ``-log(1 - u)`` by ``vexact_kernels.portable_math.log``, so the noise has the
same bits on every CPU (torch's CPU ``exponential_`` computes its log with the C library's). The two devices draw
different (each reproducible) noise. The same row, seed and token index give the same token whatever the other
rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import vexact_kernels as vk
from vexact_kernels._reduce import inclusive_scan

from .sampling_params import SamplingParams
from .seeds import token_seed, token_seeds  # noqa: F401  (the sampler's seeds; re-exported)
from .step_inputs import host_tensor

if TYPE_CHECKING:  # ablation imports this module
    from .ablation import MismatchInjection


def _exponential_cpu(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` draws of ``Exp(1)``, fp32, from a CPU generator: ``-log(1 - u)`` of float64 uniforms ``u`` in [0, 1)
    (1 - u is exact), never 0 (a zero draw would make ``p / E`` infinite, or NaN where ``p`` is 0)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    e = -vk.portable_math.log(1.0 - u)
    return e.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny)


def _filter(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k / top-p set (ties broken by token index).

    Sorting is exact and the scan adds in a fixed pattern per position, so a row's set depends on that row alone.
    """
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).expand_as(sorted_p)
    before = inclusive_scan(sorted_p) - sorted_p  # mass strictly ahead of each token
    keep_sorted = (rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0))
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return torch.where(keep, probs, 0.0)


class _Generators:
    """Reusable generators per device: seeding one is cheap, creating a CUDA one per row and step is not."""

    def __init__(self) -> None:
        self._pool: dict[torch.device, list[torch.Generator]] = {}

    def get(self, device: torch.device, n: int) -> list[torch.Generator]:
        pool = self._pool.setdefault(device, [])
        while len(pool) < n:
            pool.append(torch.Generator(device=device))
        return pool[:n]


_GENERATORS = _Generators()


def needs_filter(p: SamplingParams, vocab: int) -> bool:
    """Whether ``p`` restricts the draw to a top-k / top-p set (else the whole distribution is drawn from)."""
    return (0 < p.top_k < vocab) or p.top_p < 1.0


def draws_whole(p: SamplingParams, vocab: int) -> bool:
    """Whether a row of ``p`` draws from the whole distribution (temperature > 0, no top-k / top-p): the rows the
    fused draw takes."""
    return not p.greedy and not needs_filter(p, vocab)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], indices: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of fp32 ``logits [B, V]``; returns ``(token_ids [B], logprobs [B] fp32)`` on
    ``logits.device``.

    Row ``i`` draws with a generator seeded by ``token_seed(seeds[i], indices[i])``. No host sync.
    """
    b, vocab = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32)
    logp = vk.log_softmax(logits, temps)  # a host column: its check syncs nothing; the op moves it to the device
    tokens = torch.argmax(logp, dim=-1)  # greedy rows keep this (first index among ties)
    rand_rows = [i for i, p in enumerate(params) if not p.greedy]
    if rand_rows:
        rows = host_tensor(rand_rows, dev)  # host lists go over through pinned memory: no wait for the stream
        probs = vk.portable_math.exp(logp[rows])  # torch.exp off the CPU
        filt = [j for j, i in enumerate(rand_rows) if needs_filter(params[i], vocab)]
        if filt:
            # only rows that restrict the draw pay for the sort over the vocabulary
            top_k = host_tensor(
                [params[rand_rows[j]].top_k if params[rand_rows[j]].top_k > 0 else vocab for j in filt], dev
            )
            top_p = host_tensor([float(params[rand_rows[j]].top_p) for j in filt], dev, torch.float32)
            fr = host_tensor(filt, dev)
            probs[fr] = _filter(probs[fr], top_k, top_p)
        noise = torch.empty(len(rand_rows), vocab, device=dev)
        gens = _GENERATORS.get(dev, len(rand_rows))
        for j, i in enumerate(rand_rows):
            gen = gens[j].manual_seed(token_seed(seeds[i], indices[i]))
            if dev.type == "cpu":
                noise[j] = _exponential_cpu(vocab, gen)
            else:
                noise[j].exponential_(generator=gen)
        tokens[rows] = torch.argmax(probs / noise, dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def rows_to_host(both: torch.Tensor) -> tuple[list[int], list[float]]:
    """:func:`sample_rows_on_device`'s ``[2, S]`` rows read back: the tokens and their logprobs as host lists (one
    transfer). The last pipeline stage samples this way, as a one-device engine does on the device."""
    both = both.cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()


@torch.no_grad()
def sample_rows_on_device(
    model: torch.nn.Module,
    backend: str,
    hidden: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    indices: list[int],
    mismatch: MismatchInjection | None = None,
) -> torch.Tensor:
    """Tokens and their logprobs for pre-norm ``hidden [S, H]`` rows (token ``indices[i]`` of a request seeded
    ``seeds[i]``), as ``[2, S]`` float64 rows on ``hidden``'s device (fp32 logprobs and token ids below 2**53 are
    exact in float64: one transfer for both); the logprob is the trainer's ``model.logprobs``. Reads nothing back.

    Rows that draw from the whole distribution (temperature > 0, no top-k / top-p: an RL rollout's rows) take the
    fused draw (``model.sample``: one pass over the lm_head gives the token and its logprob, which is bitwise
    ``model.logprobs``'); greedy and filtered rows take the logits and :func:`~vexact_engine.sampler.sample`.
    With a ``mismatch`` injection (a study tool, :class:`~vexact_engine.MismatchInjection`), every row takes the
    logits, perturbed before the draw, and the reported logprob is the engine's own log_softmax of those logits.
    """
    n = len(params)
    with vk.use_backend(backend):
        if mismatch is not None and mismatch.active:
            logits = mismatch.apply(model.logits(hidden), seeds, indices)
            tokens, logprobs = sample(logits, params, seeds, indices)
        else:
            vocab = getattr(getattr(model, "config", None), "vocab_size", None)
            plain = [vocab is not None and hasattr(model, "sample") and draws_whole(p, vocab) for p in params]
            fused = [i for i in range(n) if plain[i]]
            rest = [i for i in range(n) if not plain[i]]
            tokens = torch.empty(n, dtype=torch.int64, device=hidden.device)
            logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
            for rows, draw in ((fused, _draw_fused), (rest, _draw_logits)):
                if rows:
                    sel = host_tensor(rows, hidden.device) if len(rows) < n else None
                    t, lp = draw(model, hidden if sel is None else hidden[sel], [params[i] for i in rows],
                                 [seeds[i] for i in rows], [indices[i] for i in rows])  # fmt: skip
                    if sel is None:
                        tokens, logprobs = t, lp
                    else:
                        tokens[sel], logprobs[sel] = t, lp
    return torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])


def _temperatures(params: list[SamplingParams]) -> torch.Tensor:
    # host temperatures: their check syncs nothing (the kernels move them to the device)
    return torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32)


def _draw_fused(model, hidden, params, seeds, indices):
    draw_seeds = torch.from_numpy(token_seeds(seeds, indices))
    return model.sample(hidden, _temperatures(params), draw_seeds)


def _draw_logits(model, hidden, params, seeds, indices):
    tokens, _ = sample(model.logits(hidden), params, seeds, indices)
    logprobs, _ = model.logprobs(hidden, tokens, _temperatures(params))
    return tokens, logprobs
