"""Rewrite the committed tiny checkpoint (packages/vexact-models/src/vexact_models/assets/tiny-qwen3).

Changing it changes the golden fixtures: re-record them (contracts/record_golden.py) and bump vexact-models.
"""

from pathlib import Path

from vexact_models import make_tiny_checkpoint

OUT = Path(__file__).resolve().parents[1] / "packages/vexact-models/src/vexact_models/assets/tiny-qwen3"

if __name__ == "__main__":
    make_tiny_checkpoint(OUT, seed=0)
    print(f"wrote {OUT}")
