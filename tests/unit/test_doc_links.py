"""The docs point at things that exist: every relative link in README.md, ARCHITECTURE.md and
docs/**/*.md resolves to a file or folder, and every repository path a doc names in backticks (one with
a '/' and an extension) exists. A moved or deleted file fails here, in the fast suite, instead of in a
reader's browser."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"^[\w.\-/]+/[\w.\-]*\.[A-Za-z][A-Za-z0-9]*$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
"""A path component written as a placeholder (DIR, OUT, RUN_DIR): the doc names a file a command writes."""


def _vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it (seconds)
    return Path(spec.origin).parent.parent if spec and spec.origin else None


def _prose(doc: Path) -> str:
    return FENCE.sub("", doc.read_text())  # commands in code blocks name files they write, not files here


def _relative_links(doc: Path) -> list[str]:
    out = []
    for target in LINK.findall(_prose(doc)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        out.append(target.split("#", 1)[0])
    return out


def _named_paths(doc: Path) -> list[str]:
    out = []
    for code in CODE.findall(_prose(doc)):
        code = code.strip().rstrip(".,:;")
        if not PATHLIKE.match(code) or code.startswith(("/", "~", "../")):
            continue  # not a path, or one outside the repository (/etc/..., ~/.cache/...)
        if any(PLACEHOLDER.match(part) for part in code.split("/")[:-1]):
            continue
        out.append(code)
    return out


def _exists(path: str, doc: Path) -> bool:
    vllm = _vllm_root()
    bases = [ROOT, doc.parent] + ([vllm] if vllm and path.startswith("vllm/") else [])
    return any((base / path).exists() for base in bases)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = [t for t in _relative_links(doc) if not (doc.parent / t).exists()]
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_named_files_exist(doc: Path) -> None:
    missing = sorted({p for p in _named_paths(doc) if not _exists(p, doc)})
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"
