from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import vexact_kernels as vk

# Widths of grouped outputs are multiples of this (elements): each split view then starts 16-byte aligned with a row
# stride divisible by 16, as a fresh output does, so the Triton kernels that read it specialise as on the separate ones.
GROUP_WIDTH_MULTIPLE = 16


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` on vexact-kernels; weight layout is HF's ``[out, in]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vk.linear(x, self.weight, self.bias)


def _span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``tensors`` laid end to end along dim 0 in one storage (same dtype, device and trailing shape,
    each contiguous and starting where the previous ends), or None."""
    first = tensors[0]
    end = first.data_ptr()
    rows = 0
    for t in tensors:
        if type(t) not in (torch.Tensor, nn.Parameter):  # a DTensor (FSDP) or other subclass: no raw pointers
            return None
        if t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]:
            return None
        if not t.is_contiguous() or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
        rows += t.shape[0]
    # within the first tensor's storage: adjacent addresses of another allocation would not do
    if first.untyped_storage().nbytes() < first.storage_offset() * first.element_size() + end - first.data_ptr():
        return None
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _grouped_operands(linears: Sequence[Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """The weight span, the bias span (or None) and the output widths of linears that can run as one, else None."""
    widths = [lin.weight.shape[0] for lin in linears]
    if any(w % GROUP_WIDTH_MULTIPLE for w in widths):
        return None
    weight = _span([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears]
    if weight is None or all(b is None for b in biases):
        return None if weight is None else (weight, None, widths)
    bias = None if any(b is None for b in biases) else _span(biases)
    return None if bias is None else (weight, bias, widths)


def grouped_linear(x: torch.Tensor, linears: Sequence[Linear]) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]`` (sibling projections of one input: q/k/v, gate/up), as one matmul where that
    gives the same bits, outputs split as views.

    The invariant matmul reduces every output element over K in a structure fixed by K alone, whatever N and the tile
    shape (``vexact_kernels.linear``), so one matmul over the row-concatenated weights gives, column for column, the
    bits of the separate ones. It runs only without autograd (inference: the trainer's forward under grad always
    takes the separate linears), on the ``invariant`` linear backend (the fast one's cuBLAS picks its algorithm by
    shape), and when the weights lie end to end in one storage, as ``vexact_models.pack_parameters`` lays them out
    (same dtype, device and K; biases all absent or end to end too), each of a width that is a multiple of
    ``GROUP_WIDTH_MULTIPLE``. Otherwise the separate linears run.
    """
    operands = None
    if not torch.is_grad_enabled() and vk.get_backend("linear") == "invariant":
        operands = _grouped_operands(linears)
    if operands is None:
        return [lin(x) for lin in linears]
    weight, bias, widths = operands
    return list(vk.linear(x, weight, bias).split(widths, dim=-1))  # [..., width] views of one [..., sum] output
