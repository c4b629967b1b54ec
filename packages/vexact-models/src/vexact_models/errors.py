"""The checkpoint error, and reading a checkpoint's JSON files so that a broken one is named in it.

Its own module so that both ``config`` (``config.json``) and ``loader`` (weights, index) can raise it: ``loader``
imports ``config``.
"""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """The checkpoint does not match the model (missing/unexpected tensors, wrong shapes or dtypes, bad shards), or
    one of its files cannot be read (truncated or corrupt safetensors, a JSON file that is not valid JSON)."""


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; CheckpointError naming the file and the cause if it is not one."""
    try:
        value = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got a {type(value).__name__}")
    return value
