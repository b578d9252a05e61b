"""Build a model folder all at once: it is either complete or absent, never half-written.

A build writes into a hidden temporary folder beside the target (same filesystem, so the final
rename is atomic) and renames it into place only when the builder returns. Any failure, an
interrupt included, removes the temporary folder and leaves an existing target as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


class ModelBuildError(Exception):
    """A build that cannot go on; the message is one line that names the fix."""


def build_atomically(out: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` on an empty folder beside ``out``, then put it at ``out``; returns ``out``."""
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        _chmod_as_mkdir(tmp)
        build(tmp)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _chmod_as_mkdir(path: Path) -> None:
    """mkdtemp makes a private (0700) folder; the model folder gets the mode a plain mkdir would."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)


def _replace(new: Path, out: Path) -> None:
    """Move ``new`` to ``out``; an older ``out`` is moved aside first and removed after."""
    if not out.exists():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    try:
        new.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)
