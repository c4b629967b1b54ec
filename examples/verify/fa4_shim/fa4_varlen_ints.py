"""flash-attn-4's varlen call with Python ints for ``max_seqlen_q`` / ``max_seqlen_k``, for the vllm arm's actor.

verl imports this module in each worker through its own hook, ``actor_rollout_ref.model.external_lib=fa4_varlen_ints``
(run_pair.sh puts this folder on the arm's path), before the actor's model is built. transformers 5.9's packed-row
call (verl's ``use_remove_padding``) passes ``flash_attn.cute.flash_attn_varlen_func`` the longest sequence as a 0-d
tensor (``prepare_fa_kwargs_from_position_ids``: ``cu_seq_lens.diff().max()``); flash-attn-4 4.0.0b36 builds CuTe
shapes from these and takes ints only. The wrapper turns a tensor into its int (one device-to-host read per layer and
call, as flash-attn 2's binding does when handed a tensor) and leaves every other argument as it is. transformers picks
the function up with ``from flash_attn.cute import flash_attn_varlen_func`` on its first flash-attention forward and
reads the keywords it may pass from ``inspect.signature``, which ``functools.wraps`` keeps.
"""

from __future__ import annotations

import functools

import torch

PATCHED = "_vexact_int_seqlens"


def with_int_seqlens(fn):
    """``fn`` with tensor ``max_seqlen_q`` / ``max_seqlen_k`` keywords turned into Python ints."""
    if getattr(fn, PATCHED, False):
        return fn

    @functools.wraps(fn)
    def varlen(*args, **kwargs):
        for name in ("max_seqlen_q", "max_seqlen_k"):
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"{name}: expected one length, got a tensor of shape {tuple(value.shape)}")
                kwargs[name] = int(value.item())
        return fn(*args, **kwargs)

    setattr(varlen, PATCHED, True)
    return varlen


def install() -> None:
    """Wrap ``flash_attn.cute.flash_attn_varlen_func`` in place (once)."""
    try:
        import flash_attn.cute as cute
    except Exception as e:  # the CuTe DSL's libraries, a CUDA runtime, a broken wheel
        raise ImportError(f"fa4_varlen_ints: flash_attn.cute (flash-attn-4) does not import: {e}") from e
    cute.flash_attn_varlen_func = with_int_seqlens(cute.flash_attn_varlen_func)


install()
