"""Every script under scripts/ is listed in scripts/README.md by its path, and every path listed there exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_scripts_readme_lists_every_script():
    tracked = subprocess.run(["git", "ls-files", "scripts"], cwd=ROOT, capture_output=True, text=True, check=True)
    scripts = {p for p in tracked.stdout.split() if p != "scripts/README.md"}
    readme = (ROOT / "scripts" / "README.md").read_text()
    listed = set(re.findall(r"`(scripts/[\w/.-]+\.(?:py|sh))`", readme))
    assert scripts, "no scripts tracked"
    assert not scripts - listed, f"scripts missing from scripts/README.md: {sorted(scripts - listed)}"
    assert not listed - scripts, f"scripts/README.md lists paths that do not exist: {sorted(listed - scripts)}"
