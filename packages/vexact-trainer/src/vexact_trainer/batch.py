"""Packed batches: sequences laid end to end, no padding."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from vexact_models import AttentionMetadata


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata  # packed layout (cu_seqlens)
    targets: torch.Tensor  # [T] next token of each position (0 at a sequence's last position)
    prompt_lens: list[int]
    seq_lens: list[int]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.meta.cu_seqlens

    def to(self, device: torch.device | str) -> PackedBatch:
        meta = AttentionMetadata(cu_seqlens=self.meta.cu_seqlens.to(device))
        return PackedBatch(
            self.input_ids.to(device),
            self.positions.to(device),
            meta,
            self.targets.to(device),
            self.prompt_lens,
            self.seq_lens,
        )


def pack(prompts: list[list[int]], responses: list[list[int]], vocab_size: int, max_len: int) -> PackedBatch:
    """Pack ``prompt + response`` sequences; validates lengths and token ids with errors naming the sequence."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("empty batch: no sequences to score")
    seqs, prompt_lens = [], []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        r = r.tolist() if isinstance(r, torch.Tensor) else list(r)
        if not p:
            raise ValueError(f"sequence {i}: prompt is empty")
        s = p + r
        if len(s) > max_len:
            raise ValueError(f"sequence {i} has {len(s)} tokens; the model's max length is {max_len}")
        bad = [t for t in s if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sequence {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        seqs.append(s)
        prompt_lens.append(len(p))
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    pos = torch.cat([torch.arange(n) for n in lens])
    targets = torch.cat([torch.tensor(s[1:] + [0], dtype=torch.int64) for s in seqs])
    return PackedBatch(ids, pos, AttentionMetadata.packed(lens), targets, prompt_lens, lens)


def check_temperatures(temperature, n: int, unit: str = "sequences") -> torch.Tensor:
    """The temperatures as fp32 ``[n]`` on the CPU, from a scalar (one for all), a list or a 1-D tensor (one each).

    Each must be a number that is finite and > 0 once in fp32 (logits are divided by it in fp32): a NaN or an
    infinite temperature would give NaN or flat logprobs. Raises ValueError naming the first offending value and its
    index (``unit`` names what the values are for in a length mismatch).
    """
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 0:
        temperature = temperature.item()
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() != 1:
            raise ValueError(f"temperature must be a scalar or 1-D, got a tensor of shape {tuple(temperature.shape)}")
        values, given = temperature.detach().to("cpu", torch.float32), temperature
    elif isinstance(temperature, (list, tuple)):
        for i, t in enumerate(temperature):
            if isinstance(t, bool) or not isinstance(t, numbers.Real):
                raise ValueError(f"temperature[{i}] must be a finite number > 0, got {t!r}")
        values, given = torch.tensor([float(t) for t in temperature], dtype=torch.float32), temperature
    else:
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        t32 = torch.tensor(float(temperature), dtype=torch.float32)
        _check_one(temperature, t32, "temperature")
        return t32.expand(n).clone()
    if len(values) != n:
        raise ValueError(f"{len(values)} temperatures for {n} {unit}")
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        v = given[i]
        _check_one(v.item() if isinstance(v, torch.Tensor) else v, values[i], f"temperature[{i}]")
    return values


def _check_one(value, t32: torch.Tensor, name: str) -> None:
    if value == 0:
        raise ValueError(
            f"{name} must be a finite number > 0, got {value!r}: temperature 0 (greedy) has no logprobs; the engine "
            "reports greedy tokens' logprobs at temperature 1, so score greedy rollouts with temperature=1.0"
        )
    if not (bool(torch.isfinite(t32)) and t32 > 0):
        # a value that is fine in float64 but not in fp32 (1e39, 1e-50): say what it became
        fp32 = f" ({float(t32)} in fp32)" if math.isfinite(value) and value > 0 else ""
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}{fp32}")
