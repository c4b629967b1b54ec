"""Rewrite the committed tiny checkpoints (packages/vexact-models/src/vexact_models/assets/tiny-qwen3,
tiny-qwen3-moe and tiny-deepseek-v3); ``python scripts/make_tiny_checkpoint.py deepseek_v3`` rewrites one.

Changing one changes the golden fixtures: re-record them (python -m contracts.golden --target ...) and bump
vexact-models.
"""

import sys
from pathlib import Path

from vexact_models import make_tiny_checkpoint, tiny_deepseek_v3_config, tiny_qwen3_moe_config

ASSETS = Path(__file__).resolve().parents[1] / "packages/vexact-models/src/vexact_models/assets"

if __name__ == "__main__":
    which = sys.argv[1:] or ["qwen3", "qwen3_moe", "deepseek_v3"]
    if "qwen3" in which:
        make_tiny_checkpoint(ASSETS / "tiny-qwen3", seed=0)
        print(f"wrote {ASSETS / 'tiny-qwen3'}")
    if "qwen3_moe" in which:
        make_tiny_checkpoint(ASSETS / "tiny-qwen3-moe", cfg=tiny_qwen3_moe_config(), seed=0)
        print(f"wrote {ASSETS / 'tiny-qwen3-moe'}")
    if "deepseek_v3" in which:
        make_tiny_checkpoint(ASSETS / "tiny-deepseek-v3", cfg=tiny_deepseek_v3_config(), seed=0)
        print(f"wrote {ASSETS / 'tiny-deepseek-v3'}")
