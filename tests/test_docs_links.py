"""The README and docs/ are self-contained: no link leaves the repository (a clone has no
`../shared/`), and every relative link, or backquoted `.md` path, names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_QUOTED_MD = re.compile(r"`([A-Za-z0-9_./-]+\.md)`")


def _names(document: Path) -> list[str]:
    text = document.read_text(encoding="utf-8")
    links = [link.split("#")[0] for link in _LINK.findall(text)]
    local = [link for link in links if link and not re.match(r"^[a-z]+:", link)]
    return local + _QUOTED_MD.findall(text)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_link_leaves_the_repository(document: Path) -> None:
    assert "../shared" not in document.read_text(encoding="utf-8")
    for name in _names(document):
        target = (document.parent / name).resolve()
        assert target.is_relative_to(ROOT), f"{name} is outside the repository"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_names_a_file(document: Path) -> None:
    # A backquoted path may be written from the repository's root (`docs/internals.md`).
    missing = [
        name
        for name in _names(document)
        if not (document.parent / name).exists() and not (ROOT / name).exists()
    ]
    assert not missing, f"{document.relative_to(ROOT)} names files that do not exist: {missing}"
