"""Rewrite the committed tiny checkpoints (packages/vexact-models/src/vexact_models/assets/tiny-<family>):
``python scripts/make_tiny_checkpoint.py [family ...]`` (default: every family).

Changing one changes the golden fixtures: re-record them (python -m contracts.golden --target ...) and bump
vexact-models.
"""

import sys

from vexact_models import (
    default_checkpoint,
    make_tiny_checkpoint,
    tiny_config,
    tiny_deepseek_v3_config,
    tiny_qwen3_moe_config,
)

FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral", "deepseek_v3")
NON_DENSE = {"qwen3_moe": tiny_qwen3_moe_config, "deepseek_v3": tiny_deepseek_v3_config}

if __name__ == "__main__":
    which = sys.argv[1:] or FAMILIES
    unknown = sorted(set(which) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; have {list(FAMILIES)}")
    for family in which:
        cfg = NON_DENSE[family]() if family in NON_DENSE else tiny_config(family)
        make_tiny_checkpoint(default_checkpoint(family), cfg=cfg, seed=0)
        print(f"wrote {default_checkpoint(family)}")
