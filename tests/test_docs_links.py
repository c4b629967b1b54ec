"""Relative links in the READMEs and the docs pages point to files of the repository.

Markdown links and images (``[text](path)``, ``![alt](path)``) outside code are read; web addresses and in-page
anchors are skipped, and a ``#anchor`` after a path is dropped (``mkdocs build --strict``, ``nox -s docs``, checks
the anchors of the docs site). The docs pages link only to one another: the site holds ``docs/`` alone, so a link
out of it would break there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SKIP = {".git", "outputs", ".nox", "node_modules", "site"}


def pages() -> list[Path]:
    readmes = [p for p in ROOT.rglob("README.md") if not SKIP & set(p.relative_to(ROOT).parts)]
    return sorted(readmes + list(DOCS.glob("*.md")))


def links(text: str) -> list[str]:
    """The targets of the Markdown links in ``text``, leaving out fenced blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def test_links_are_read():
    text = "see [a](docs/a.md#x), ![img](b.png) and [web](https://x.org)\n```\n[no](c.md)\n```\n`[no](d.md)`"
    assert links(text) == ["docs/a.md#x", "b.png", "https://x.org"]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(f"{target} (no {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        elif page.parent == DOCS and not path.is_relative_to(DOCS):
            broken.append(f"{target} (outside docs/: the site holds docs/ alone)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
