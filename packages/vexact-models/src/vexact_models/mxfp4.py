"""MXFP4 expert weights (gpt-oss's released checkpoints), dequantised to bf16 at load.

A checkpoint stores each stacked expert projection ``P`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``)
as two uint8 tensors: ``P_blocks [E, rows, G, 16]`` (two 4-bit e2m1 codes a byte, the low nibble first: 32 values a
block) and ``P_scales [E, rows, G]`` (one e8m0 exponent a block, biased by 127). The value of a code ``c`` in a block
of scale ``s`` is ``FP4_VALUES[c] * 2**(s - 127)``; the ``[E, rows, G * 32]`` result is transposed to the model's
``[E, G * 32, rows]`` (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``). The arithmetic is transformers' own
(``integrations/mxfp4.py: _convert_moe_packed_tensors``: a bf16 lookup, then ``torch.ldexp`` into bf16), so the bf16
weights are bit for bit the ones transformers loads (``tests/test_gpt_oss.py`` compares them with ``torch.equal``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from .errors import CheckpointError

# e2m1: sign, two exponent bits, one mantissa bit (transformers' FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[E, rows, G, B]`` uint8 blocks and ``[E, rows, G]`` uint8 scales -> ``[E, G * 2B, rows]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair (blocks [..., G, B], "
            "scales [..., G])"
        )
    *prefix, g, b = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    flat = blocks.reshape(-1, b)
    out = torch.empty(flat.shape[0], 2 * b, dtype=dtype)
    out[:, 0::2] = lut[(flat & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(flat >> 4).to(torch.int)]
    torch.ldexp(out, scales.reshape(-1, 1).to(torch.int32) - 127, out=out)
    return out.reshape(*prefix, g * 2 * b).transpose(1, 2).contiguous()


def dequantized_mxfp4(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``(name, tensor)`` pairs with every MXFP4 pair (``P_blocks`` + ``P_scales``, in any order and
    any shards) replaced by ``(P, bf16 tensor)``; every other tensor passes through as it comes. A half pair left at
    the end raises CheckpointError naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        suffix = next((s for s in (BLOCKS, SCALES) if name.endswith(s)), None)
        if suffix is None or tensor.dtype != torch.uint8:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        halves = pending.setdefault(base, {})
        halves[suffix] = tensor
        if len(halves) == 2:
            del pending[base]
            yield base, dequantize_mxfp4(halves[BLOCKS], halves[SCALES])
    if pending:
        base, halves = next(iter(pending.items()))
        missing = BLOCKS if BLOCKS not in halves else SCALES
        raise CheckpointError(f"MXFP4 tensor {base}{missing} is missing (its pair {base}{next(iter(halves))} is here)")
