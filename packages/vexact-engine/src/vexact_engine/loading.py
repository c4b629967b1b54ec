"""An engine's model and tokenizer from a checkpoint directory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vexact_models import load_model, pack_parameters

from .config import EngineConfig
from .kv_cache import check_model_fits

log = logging.getLogger("vexact_engine")


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer through transformers, or None when it has none (token-id prompts only)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("transformers is not installed: %s's tokenizer is not loaded; pass token ids", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))


def load_engine_model(model_path: str | Path, config: EngineConfig) -> torch.nn.Module:
    """The checkpoint's model on ``config.device``, its weights packed when ``config.pack_weights``.

    It loads on the host first, so that a model too large for the device's budget fails with the figures.
    """
    model = load_model(model_path, dtype=config.dtype, device="cpu")
    device = torch.device(config.device)
    if device.type == "cuda":
        check_model_fits(model, config, device)
    if config.pack_weights:
        pack_parameters(model, device)  # from the host straight into the flat buffers: one device copy
    return model.to(device)  # the buffers (and the parameters, unpacked)
