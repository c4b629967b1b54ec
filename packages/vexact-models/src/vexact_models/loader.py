"""Hugging Face checkpoints: ``config.json`` + safetensors shards (single file or indexed), both ways."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .config import parse_dtype
from .errors import CheckpointError, read_json_object
from .layers.moe import checkpoint_pieces, named_weights, stacked_experts
from .models import CONFIG_CLASSES, MODEL_CLASSES
from .mxfp4 import dequantized_mxfp4

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_config(path: str | Path):
    """Read ``config.json`` from a checkpoint directory (or the file itself); CheckpointError naming the file if it
    is not a valid JSON object."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    return config_from_dict(read_json_object(p))


def config_from_dict(d: dict):
    model_type = d.get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[model_type].from_hf_dict(d)


def _weight_map(path: Path) -> dict[str, str] | None:
    """The index's tensor name -> shard file map; None for a checkpoint without an index."""
    index = path / INDEX_FILE
    if not index.is_file():
        return None
    weight_map = read_json_object(index).get("weight_map")
    if not weight_map or not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map (an object of tensor name -> shard file)")
    return weight_map


def _shard_files(path: Path, weight_map: dict[str, str] | None) -> list[Path]:
    if weight_map is not None:
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint {path}: shard(s) {missing} listed in {INDEX_FILE} are missing")
        return [path / s for s in shards]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return found


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of every shard.

    A shard that safetensors cannot read (truncated, corrupt) or an index that is not valid JSON raises
    CheckpointError naming the file and the cause.
    """
    p = Path(path)
    weight_map = _weight_map(p)
    for shard in _shard_files(p, weight_map):
        try:
            # a consumer's exception is not thrown into the generator, so only reading the shard is caught here
            with safe_open(str(shard), framework="pt") as f:
                names = list(f.keys())
                if weight_map is not None:
                    listed = {n for n, s in weight_map.items() if s == shard.name}
                    if listed - set(names):
                        raise CheckpointError(
                            f"shard {shard.name} lacks tensors its index lists: {sorted(listed - set(names))[:5]}"
                        )
                for name in names:
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{shard} is not a readable safetensors file (truncated or corrupt?): {e}") from e


def expected_tensors(model: nn.Module, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the model tensor (or view of one) it loads into, in the published layout: stacked expert
    parameters appear as one view per expert and projection; persistent buffers (DeepSeek's fp32
    ``e_score_correction_bias``) are checkpoint tensors too. Tied weights appear once, under their first name
    (under each of their names with ``remove_duplicate=False``)."""
    named = named_weights(model, remove_duplicate=remove_duplicate)
    stacked = stacked_experts(model)
    return {hf: t for n, p in named for hf, t in checkpoint_pieces(n, p, stacked)}


def _split_stacked(params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> list | None:
    """A whole stacked expert tensor (transformers' in-memory layout) as its per-expert pieces, or None."""
    if name not in params or len(checkpoint_pieces(name, params[name])) == 1:
        return None
    if tuple(tensor.shape) != tuple(params[name].shape):
        raise CheckpointError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(params[name].shape)} "
            "(does config.json match the weights?)"
        )
    return checkpoint_pieces(name, tensor)


def load_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> list[str]:
    """Copy HF-named tensors into ``model`` with name, shape and dtype checks. Returns the checkpoint names loaded.

    Expert weights load from either layout: one tensor per expert (``...experts.{i}.gate_proj.weight``, as published
    checkpoints and transformers' ``save_pretrained`` store them) or the stacked tensor (``...experts.gate_up_proj``,
    transformers' in-memory layout), which counts as its per-expert names. MXFP4 expert tensors (gpt-oss's
    ``..._blocks`` and ``..._scales`` pairs) are dequantised to bf16 first, bit for bit as transformers does
    (``mxfp4.py``).

    ``strict``: every model parameter must be provided (a full checkpoint); otherwise a partial update is allowed.
    """
    targets = expected_tensors(model)
    params = dict(model.named_parameters())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded, unexpected = [], []
    with torch.no_grad():
        for name, tensor in dequantized_mxfp4(named_tensors):
            _refuse_quantized(name, tensor)
            pieces = [(name, tensor)] if name in targets else _split_stacked(params, name, tensor)
            if pieces is None:
                if tied and name == "lm_head.weight":
                    continue  # some tied checkpoints still store the head; the model uses the embedding
                unexpected.append(name)
                continue
            for piece, t in pieces:
                _copy_checked(piece, t, targets[piece])
                loaded.append(piece)
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} tensor(s) the model does not have, e.g. {unexpected[:5]}")
    if strict:
        missing = sorted(set(targets) - set(loaded))
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
    return loaded


_FP8 = {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
}


def _refuse_quantized(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype in _FP8 or name.endswith(("weight_scale_inv", "weight_scale")):
        raise CheckpointError(
            f"{name} ({tensor.dtype}) is an FP8 checkpoint's tensor: quantized checkpoints are not supported; "
            "dequantize the weights to bf16 first"
        )


def _copy_checked(name: str, tensor: torch.Tensor, dst: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise CheckpointError(f"{name}: checkpoint dtype {tensor.dtype} is not a floating-point type")
    if tuple(tensor.shape) != tuple(dst.shape):
        raise CheckpointError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)} "
            "(does config.json match the weights?)"
        )
    dst.copy_(tensor.to(dst.dtype))


def load_model(path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"):
    """Build the model named by ``config.json``'s model_type and load its safetensors weights."""
    path = Path(path)
    cfg = load_config(path)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, torch_dtype=str(parse_dtype(dtype)).removeprefix("torch."))
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.model_type](cfg)
    model = model.to_empty(device="cpu")
    _reset_buffers(model, cfg)
    load_weights(model, iter_checkpoint(path), strict=True)
    return model.to(device).eval().requires_grad_(False)


def _reset_buffers(model: nn.Module, cfg) -> None:
    # Non-persistent buffers (rotary tables) are not in the checkpoint: rebuild them after meta init.
    fresh = model.model.rotary_emb.rebuilt()
    model.model.rotary_emb.cos = fresh.cos
    model.model.rotary_emb.sin = fresh.sin
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def save_checkpoint(model: nn.Module, path: str | Path, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and safetensors weights (sharded with an index if ``max_shard_bytes`` is set)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {n: p.detach().contiguous().cpu() for n, p in expected_tensors(model).items()}
    if max_shard_bytes is None:
        save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
    }
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
