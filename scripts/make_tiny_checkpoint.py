"""Rewrite the committed tiny checkpoints (packages/vexact-models/src/vexact_models/assets/tiny-<name>):
``python scripts/make_tiny_checkpoint.py [name ...]`` (default: every one; the names are vexact_models'
``TINY_CHECKPOINTS``: one per family, then the variants of ``TINY_VARIANTS``).

Changing one changes the golden fixtures: re-record them (python -m contracts.golden --target ...) and bump
vexact-models.
"""

import sys

from vexact_models import TINY_CHECKPOINTS, write_tiny_checkpoint

if __name__ == "__main__":
    which = sys.argv[1:] or TINY_CHECKPOINTS
    unknown = sorted(set(which) - set(TINY_CHECKPOINTS))
    if unknown:
        raise SystemExit(f"unknown tiny checkpoints {unknown}; have {list(TINY_CHECKPOINTS)}")
    for name in which:
        print(f"wrote {write_tiny_checkpoint(name)}")
