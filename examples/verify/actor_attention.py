"""The vllm arm's actor attention: transformers' FlashAttention 4 path where it can run, else SDPA.

    PYTHONPATH=FA4_DIRS:VLLM_DIRS python examples/verify/actor_attention.py   # run_pair.sh evaluates what it prints

Prints three shell lines: ``ACTOR_ATTN=flash_attention_4`` or ``ACTOR_ATTN=sdpa``, ``ACTOR_ATTN_WHY=...`` (what
was found, or why FA4 was not taken) and ``ACTOR_ATTN_LIB=...`` (the module verl imports in its workers through
``actor_rollout_ref.model.external_lib`` for FA4 to run: ``fa4_varlen_ints`` from ``fa4_shim/``, or empty);
``ACTOR_ATTN`` in the environment is kept as given ("set by ACTOR_ATTN", and for a forced ``flash_attention_4``
what stops FA4 here, if anything).

What FA4 needs on the arm's path (verl 0.9.1's FSDP engine, transformers 5.9, flash-attn-4 4.0.0b36); the last
item fails with these versions as they ship, and ``fa4_shim/fa4_varlen_ints.py`` mends it:
- transformers takes ``flash_attention_4`` when the distribution ``flash-attn-4`` provides the ``flash_attn`` package
  (``is_flash_attn_4_available`` reads ``importlib.metadata.packages_distributions()``, so a ``pip install --target``
  folder must keep its ``flash_attn_4-*.dist-info`` beside ``flash_attn/``) and CUDA is there (compute capability 9
  or more). With ``use_remove_padding`` verl packs a micro-batch into one row and passes its ``position_ids``;
  transformers finds the sequences from them and calls ``flash_attn.cute.flash_attn_varlen_func`` with their
  ``cu_seqlens`` (int32) and ``causal=True``; flash-attn-4 4.0.0b36 has that varlen forward and backward on SM90
  (``FlashAttentionBackwardSm90``; head dim 128, GQA). verl's remove-padding patch wraps transformers'
  ``_flash_attention_forward`` for every flash implementation alike: nothing in verl asks for flash_attention_2.
- every requirement of flash-attn-4 at a version it accepts. vLLM 0.24.0 pins ``apache-tvm-ffi==0.1.9`` and
  flash-attn-4 needs ``>=0.1.11``: FA4's folder goes in front of vLLM's on the arm's path (run_pair.sh does so).
- ``import flash_attn.cute`` (the CuTe DSL and its libraries load).
- Python ints for ``max_seqlen_q`` / ``max_seqlen_k``. transformers 5.9 does not pass them: its
  ``prepare_fa_kwargs_from_position_ids`` returns ``cu_seq_lens_q.diff().max()``, a 0-d tensor, and
  ``_process_flash_attention_kwargs`` calls ``.item()`` on it only while tracing (torch.compile, CUDA graph capture),
  so the eager packed-row call hands flash-attn-4 a tensor. flash-attn-4 4.0.0b36 takes ints only (its CuTe layout
  code): on an H200 the vllm arm's first actor forward failed in ``_flash_attn_fwd`` with ``ValueError: Expected
  IntTuple, whose leaves are integers, but got 1079``. ``max_seqlen_problem`` runs that transformers function on a
  CPU tensor; where it finds a tensor, FA4 is taken with ``fa4_varlen_ints``, which wraps flash-attn-4's varlen
  function to turn the two lengths into ints (``ACTOR_ATTN_LIB``), and the reason says so.
"""

from __future__ import annotations

import os
import shlex
import sys
from importlib import metadata

FA4 = "flash_attention_4"
FALLBACK = "sdpa"
FA4_DIST = "flash-attn-4"
INT_SEQLENS_LIB = "fa4_varlen_ints"  # fa4_shim/fa4_varlen_ints.py: verl imports it in its workers (external_lib)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def _where(dist: metadata.Distribution) -> str:
    return str(dist.locate_file(""))


def fa4_problem() -> str | None:
    """Why transformers' FA4 path cannot run from this interpreter's path, even with ``fa4_varlen_ints``; None when
    it can (``max_seqlen_problem`` says whether it needs that module)."""
    from packaging.requirements import Requirement

    providers = [_norm(d) for d in metadata.packages_distributions().get("flash_attn", [])]
    if FA4_DIST not in providers:
        found = f"flash_attn comes from {providers}" if providers else "no distribution provides flash_attn"
        return f"{found}; transformers takes FA4 only from the distribution {FA4_DIST} (its dist-info on the path)"
    dist = metadata.distribution(FA4_DIST)
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement (cu13, dev)
        try:
            dep = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            return f"{FA4_DIST} {dist.version} needs {req}: not installed"
        if req.specifier and not req.specifier.contains(dep.version, prereleases=True):
            return f"{FA4_DIST} {dist.version} needs {req}; the path has {dep.version} from {_where(dep)} first"
    try:
        import transformers.utils.import_utils as tiu
    except ImportError as e:
        return f"transformers does not import: {e}"
    if not hasattr(tiu, "is_flash_attn_4_available"):
        import transformers

        return f"transformers {transformers.__version__} has no flash_attention_4 path"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # the DSL's libraries, a CUDA runtime, a broken wheel: any of them stops FA4
        return f"import flash_attn.cute fails: {type(e).__name__}: {e}"
    return None


def max_seqlen_problem(fa4_version: str) -> str | None:
    """Why transformers' packed-row call would hand flash-attn-4 a non-int ``max_seqlen``; None when it passes ints.

    Runs transformers' ``prepare_fa_kwargs_from_position_ids`` (where it has one) on two packed sequences on the CPU:
    the max length it returns is what the eager varlen call passes as ``max_seqlen_q`` / ``max_seqlen_k``.
    """
    try:
        from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
    except ImportError:
        return None
    import torch
    import transformers

    _, (max_q, max_k) = prepare_fa_kwargs_from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
    if isinstance(max_q, int) and isinstance(max_k, int):
        return None
    return (
        f"transformers {transformers.__version__} passes max_seqlen_q/max_seqlen_k to flash_attn_varlen_func as "
        f"{type(max_q).__module__}.{type(max_q).__name__} ({max_q!r}), and {FA4_DIST} {fa4_version} takes Python ints "
        "only: on an H200 the first actor forward failed with ValueError: Expected IntTuple, whose leaves are "
        "integers, but got 1079"
    )


def choose(requested: str | None = None) -> tuple[str, str, str]:
    """(attention, why, lib): ``requested`` as given; else FA4 where ``fa4_problem`` finds nothing, else SDPA. ``lib``
    is ``fa4_varlen_ints`` where FA4 runs and transformers would hand it tensor lengths, else empty."""
    if requested and requested != FA4:
        return requested, "set by ACTOR_ATTN", ""
    problem = fa4_problem()
    if problem is not None:
        if requested == FA4:
            return FA4, f"set by ACTOR_ATTN; FA4 is not usable here ({problem})", ""
        return FALLBACK, f"SDPA: FA4 is not usable here ({problem})", ""
    dist = metadata.distribution(FA4_DIST)
    why = f"FA4: {FA4_DIST} {dist.version} from {_where(dist)}, varlen over the packed row"
    if requested == FA4:
        why = "set by ACTOR_ATTN"
    seqlens = max_seqlen_problem(dist.version)
    if seqlens is None:
        return FA4, why, ""
    return FA4, f"{why}; {INT_SEQLENS_LIB} turns max_seqlen_q/max_seqlen_k into ints ({seqlens})", INT_SEQLENS_LIB


def main() -> int:
    attn, why, lib = choose(os.environ.get("ACTOR_ATTN") or None)
    print(f"ACTOR_ATTN={shlex.quote(attn)}")
    print(f"ACTOR_ATTN_WHY={shlex.quote(why)}")
    print(f"ACTOR_ATTN_LIB={shlex.quote(lib)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
