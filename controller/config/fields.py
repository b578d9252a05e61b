"""How a table's typed field documents and checks itself: every field carries its doc and bounds
(``_f`` in ``load.py``), and a value is checked against them with an error that names the key, the
value and the fix (STYLE.md practice 7)."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import field
from typing import Any


def doc_field(default: Any, doc: str, lo: float | None = None, hi: float | None = None) -> Any:
    """A dataclass field with its doc and its inclusive bounds (None: unbounded)."""
    return field(default=default, metadata={"doc": doc, "lo": lo, "hi": hi})


def suggest(key: str, known: list[str]) -> str:
    """The fix for an unknown key: the nearest known one, else the list."""
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"


_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


def check_value(table: str, f: dataclasses.Field[Any], value: Any) -> list[str]:
    """``value`` for field ``f`` of ``[table]``: its type and bounds."""
    want = _TYPES[str(f.type).removesuffix(" | None")]  # TOML has no None: a file sets a value or nothing
    where = f"[{table}] {f.name} = {value!r}"
    ok = isinstance(value, want) or (want is float and isinstance(value, int))
    if not ok or isinstance(value, bool):
        return [f"{where}: must be {want.__name__}. {f.metadata['doc']}"]
    lo, hi = f.metadata["lo"], f.metadata["hi"]
    if isinstance(value, float) and not math.isfinite(value):  # NaN is neither below nor above a bound
        return [f"{where}: not a finite number; use a value in [{lo}, {hi}]. {f.metadata['doc']}"]
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        return [f"{where}: out of range; use a value in [{lo}, {hi}]. {f.metadata['doc']}"]
    return []


def non_finite_errors(table: str, values: dict[str, Any]) -> list[str]:
    """Every NaN or infinity in a free-form table (``[engine]``, ``[server]``'s vLLM options,
    ``[control.params]``), nested tables and lists included, named by its key: TOML accepts ``nan``
    and ``inf``, no setting means either, and a NaN passes any range check written ``value < lo``."""
    return [e for key, value in values.items() for e in _non_finite(f"[{table}] {key}", value)]


def _non_finite(where: str, value: Any) -> list[str]:
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where} = {value!r}: not a finite number; write a number (TOML's nan and inf set nothing)"]
    if isinstance(value, dict):
        return [e for k, v in value.items() for e in _non_finite(f"{where}.{k}", v)]
    if isinstance(value, list):
        return [e for i, v in enumerate(value) for e in _non_finite(f"{where}[{i}]", v)]
    return []
