"""A device tensor's value range, read from the GPU once per tensor version instead of once per check.

An input check on a CUDA tensor (every position inside the rotary table, every token id inside the vocabulary, every
expert id below E) reads the tensor's min and max on the host, and a host read waits for the GPU to finish all the work
queued before it. A model checks the same tensor in every layer (the step's positions in each layer's rotary), so an
eager forward that read it each time would stall its host behind the GPU once a layer: the GPU then idles while the host
launches the next layer. On the engine's eager steps (prompt chunks mixed with decode rows; 28 layers) that makes a step
four times its GPU time (H100, Qwen3-1.7B shape, 64 decode rows + a 1024-token chunk: 60 ms wall, 12.5 ms of kernels).

So :func:`tensor_range` remembers what it read for the exact tensor object and its version (an in-place write bumps
the version, and the range is read again), and an op that makes a tensor whose range it knows by construction (the
MoE routers' top-k ids, each below E) records it with :func:`record_range` without reading it. A check still runs
on every call: only the read it would repeat is saved. Nothing is remembered during a CUDA graph capture (a capture
reads nothing on the host) or for inference-mode tensors (they keep no version).
"""

from __future__ import annotations

import weakref

import torch

_KNOWN: dict[int, tuple[weakref.ref, int, int, int]] = {}  # id(t) -> (ref to t, t._version, min, max)
_LIMIT = 256  # entries kept before the dead ones are dropped (a step makes a handful)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensor: no version counter
        return None


def record_range(t: torch.Tensor, lo: int, hi: int) -> None:
    """Note that every value of ``t`` lies in ``[lo, hi]``, known without reading it (the caller made ``t``)."""
    ver = _version(t)
    if ver is None or not t.numel():
        return
    if len(_KNOWN) >= _LIMIT:
        for key in [k for k, v in _KNOWN.items() if v[0]() is None]:
            del _KNOWN[key]
        if len(_KNOWN) >= _LIMIT:
            _KNOWN.clear()
    _KNOWN[id(t)] = (weakref.ref(t), ver, lo, hi)


def tensor_range(t: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of a non-empty integer tensor as host ints, from one host read per tensor version; ``None`` for
    an empty tensor and while a CUDA graph is being captured (a capture cannot read the device: callers skip their
    check then, as the replayed step's inputs are the engine's own)."""
    if not t.numel():
        return None
    hit = _KNOWN.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == _version(t):
        return hit[2], hit[3]
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    lo, hi = _read(t)
    record_range(t, lo, hi)
    return lo, hi


def _read(t: torch.Tensor) -> tuple[int, int]:
    lo, hi = torch.stack([t.min(), t.max()]).tolist()  # one host read for both
    return int(lo), int(hi)
