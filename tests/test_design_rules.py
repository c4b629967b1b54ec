"""Every "design.md rule N" cited in a tracked file names a rule that docs/design.md defines ("### Rule N: ...")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
CITATION = re.compile(r"design\.md,?\s+rules?\s+(\d+(?:\s*(?:,|and|or|-)\s*\d+)*)", re.I)


def cited_rules(text: str) -> set[int]:
    """The rule numbers that ``text`` cites as "design.md rule N" (or "design.md rules N and M", "N-M")."""
    rules: set[int] = set()
    for match in CITATION.finditer(text):
        for lo, hi in re.findall(r"(\d+)(?:\s*-\s*(\d+))?", match.group(1)):
            rules.update(range(int(lo), int(hi or lo) + 1))
    return rules


def defined_rules() -> set[int]:
    return {int(n) for n in re.findall(r"^### Rule (\d+):", DESIGN.read_text(), re.M)}


def test_citations_are_read():
    assert cited_rules("The rule (design.md rule 3): a query walks") == {3}
    assert cited_rules("see design.md rules 2 and 5, and design.md rule 7-8") == {2, 5, 7, 8}
    assert cited_rules("design.md describes the rules") == set()


def test_every_cited_rule_resolves():
    defined = defined_rules()
    assert defined == set(range(1, len(defined) + 1)), f"rules in {DESIGN} are numbered 1..N: {sorted(defined)}"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    missing = []
    for rel in filter(None, files.split("\0")):
        path = ROOT / rel
        if rel == Path(__file__).relative_to(ROOT).as_posix() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        missing += [f"{rel}: rule {n}" for n in sorted(cited_rules(text) - defined)]
    assert not missing, f"citations of rules that {DESIGN.relative_to(ROOT)} does not define:\n" + "\n".join(missing)
    assert cited_rules((ROOT / "packages/vexact-kernels/src/vexact_kernels/triton_ops/attention.py").read_text())
