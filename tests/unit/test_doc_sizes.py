"""The front door and the doc pages stay within their sizes: README.md and ARCHITECTURE.md (the map:
per room what it owns, may import and keeps true; the detail in docstrings) at most 12,000 characters,
every other page at most 40,000 (a results page holds the current figures; history moves out)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRONT_DOOR = ROOT / "README.md"
MAP = ROOT / "ARCHITECTURE.md"
PAGES = sorted(
    p
    for pattern in ("*.md", "docs/**/*.md", "deploy/**/*.md")
    for p in ROOT.glob(pattern)
    if p not in (FRONT_DOOR, MAP)
)


def test_the_readme_is_at_most_12000_characters() -> None:
    size = len(FRONT_DOOR.read_text(encoding="utf-8"))
    assert size <= 12_000, f"README.md is {size:,} characters: move detail to docs/ (the bound is 12,000)"


def test_the_map_is_at_most_12000_characters() -> None:
    size = len(MAP.read_text(encoding="utf-8"))
    assert size <= 12_000, (
        f"ARCHITECTURE.md is {size:,} characters: move detail to docstrings (the bound is 12,000)"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_is_at_most_40000_characters(page: Path) -> None:
    size = len(page.read_text(encoding="utf-8"))
    assert size <= 40_000, f"{page.relative_to(ROOT)} is {size:,} characters: split it (the bound is 40,000)"
