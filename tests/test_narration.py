"""Tracked files speak of the project, not of how it was developed.

No numbered work periods, no GPU leases or loans, no tool or machine that lent a GPU, no transfer budget of one
particular machine, and no history in the present documents ("the run before", "was 4626", "25.6% before"): that
belongs to ``CHANGELOG.md`` and git. nox's own sessions (``@nox.session``, ``nox -s``, "nox sessions") and pytest's
``scope="session"`` are the tools' words and stay.

``test_patterns_catch_narration`` runs the patterns on examples of both kinds, so the scan cannot pass by matching
nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
CHANGELOG = "CHANGELOG.md"

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    "fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(?:st|nd|rd|th)"
)
_UNIT = r"(?:%|x|ms|us|s|GB/s|TB/s|TFLOP/s|kernels)"

# Words of the tools that are allowed to say "session"; removed from a line before the patterns run.
_ALLOWED = re.compile(
    r"@?nox\.session\b|\bnox\.Session\b|\bnox\s+sessions?\b|\bsessions?\s+\(nox\)|nox -s\b"
    r"|scope\s*=\s*[\"']session[\"']|\bsession\.(?:run|install|posargs|env|notify|log|error|skip|chdir|python|name)\b"
    r"|\bnox\.options\.sessions\b|\(session\b|\brequest\.session\.items\b",  # the last: pytest's collected tests
)

# Each: (name, what it flags, whether CHANGELOG.md may use it).
PATTERNS: list[tuple[str, re.Pattern[str], bool]] = [
    ("work period", re.compile(rf"\b(?:{_ORDINALS})\s+(?:session|work period)s?\b", re.I), False),
    ("session", re.compile(r"\bsessions?(?:'s)?\b", re.I), False),
    ("lease or loan", re.compile(r"\b(?:leases?|leased|loans?|loaned)\b", re.I), False),
    (
        "lent GPU",
        re.compile(
            r"\b(?:GPU|device|machine)s?\b[^.;:]{0,40}\b(?:lent|lend|lends|lending)\b"
            r"|\b(?:lent|lend|lends|lending)\b[^.;:]{0,40}\b(?:GPU|device|machine)s?\b",
            re.I,
        ),
        False,
    ),
    (
        "lending machinery",
        re.compile(
            r"\b`?device`?[ -](?:tool|call)s?\b|\bmachine back\b|\bmachine warm\b|\bwarm machine\b"
            r"|\bnvidia-[hb]\d00(?:-x\d+)?\b",
            re.I,
        ),
        False,
    ),
    ("transfer budget", re.compile(r"\bMiB\s+(?:a|per|each)\s+(?:device\s+)?call\b|\ba call carries\b", re.I), False),
    (
        "history",
        re.compile(
            rf"\bthe runs? before\b|\b(?:was|were)\s+\d[\d.,]*\b|\d(?:\.\d+)?\s*{_UNIT}\s+before\b"
            r"|\bbefore this (?:change|commit)\b",
            re.I,
        ),
        True,
    ),
]


def narration(line: str, *, history_allowed: bool = False) -> list[str]:
    """The names of the patterns that ``line`` matches."""
    text = _ALLOWED.sub(" ", line)
    return [name for name, rx, in_changelog in PATTERNS if not (history_allowed and in_changelog) and rx.search(text)]


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p and p != SELF]


def test_patterns_catch_narration():
    flagged = [
        "code at 7e4859c (the fifteenth session's run)",
        "a CI run of the 10th session",
        "The file itself was lost with the lease that made it.",
        "NOT YET RUN ON A GPU (no device was lent in the period that wrote it)",
        "the device tool brings back at most 8 files",
        "PART_MIB=56  # a call carries 64 MiB together with the working tree",
        "wheels cut into parts (64 MiB a call)",
        "Command (nvidia-h100-x1, alone on the GPU)",
        "The run before had FA4 attention",
        "3106 kernels a step, was 4626.",
        "trainer MFU 43.1% (goal 40%; 25.6% before)",
        "the machine gives its machine back 30 s after a call ends",
    ]
    for line in flagged:
        assert narration(line), line
    assert narration("was 4626", history_allowed=True) == []
    assert narration("the tenth session", history_allowed=True) == ["work period", "session"]
    fine = [
        "@nox.session(venv_params=['--system-site-packages'])",
        "def contracts(session, target):",
        '    session.install("-r", "requirements/test.txt")',
        '@pytest.fixture(scope="session")',
        "cases = [c for item in request.session.items if item.path == here]",
        "## nox sessions",
        "`nox -s tests` (CPU suite)",
        "async def release(self):  # verl's release of the KV cache",
        "each shard is cast to bf16 before the all-gather",
        "the sixth is bad",
        "a call to the device's allocator",
    ]
    assert narration("an H100 profile of the trainer in the tenth session).") == ["work period", "session"]
    for line in fine:
        assert narration(line) == [], line


def test_no_narration_in_tracked_files():
    hits = []
    for rel in tracked_text_files():
        path = ROOT / rel
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            names = narration(line, history_allowed=rel == CHANGELOG)
            if names:
                hits.append(f"{rel}:{no}: [{', '.join(names)}] {line.strip()[:160]}")
    if hits:
        head = f"{len(hits)} lines narrate the project's development (history goes to {CHANGELOG}):"
        pytest.fail("\n".join([head, *hits]))
