"""How a config table's key describes and checks itself: a ``Key`` holds its name, kind, inclusive
bounds, doc and (for a name) its choices, and checks a value with an error that names the table, the
key, the value and the fix (STYLE.md practice 7). The checks themselves are ``policies/common.py``'s
``check_*``, the ones constructor parameters pass; a ``Key`` adds the table and its doc.

The dataclass tables of ``load.py`` declare their keys as fields (``doc_field``, read back as a
``Key`` by ``field_key``); ``[admission.classes.NAME]`` (``classes_table.py``) and ``[slo]``
(``slo_table.py``) declare theirs as ``Key``s. An unknown key's fix is ``suggest``'s."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from policies.base import PolicyError
from policies.common import check_choice, check_float, check_int, check_str


@dataclass(frozen=True)
class Key:
    """One key of a config table."""

    name: str
    kind: type[int] | type[float] | type[str]
    """What a value must be; a TOML integer is a float too (``2`` for ``2.0``)."""
    lo: float | None = None
    """Lowest value (inclusive); None: unbounded."""
    hi: float | None = None
    """Highest value (inclusive); None: unbounded."""
    doc: str = ""
    """What the key means: the reference's text (``reference.py``), and the end of every error."""
    choices: tuple[str, ...] = ()
    """For a ``str`` key that names one of a few things: those names."""

    def check(self, where: str, value: object) -> list[str]:
        """``value`` for this key of table ``where`` (``control``, ``admission.classes.chat``): its
        type, finiteness, bounds or choices; the errors, as "[where] key = value: problem; fix. doc"."""
        try:
            self._checked(value)
        except PolicyError as exc:
            return [f"[{where}] {exc}. {self.doc}"]
        return []

    def typed(self, value: Any) -> Any:
        """A value that passed ``check`` as the table holds it: a TOML integer as a float for a float key."""
        return float(value) if self.kind is float else value

    def _checked(self, value: object) -> object:
        lo = -math.inf if self.lo is None else self.lo
        hi = math.inf if self.hi is None else self.hi
        if self.choices:
            return check_choice(self.name, value, self.choices)
        if self.kind is float:
            return check_float(self.name, value, lo, hi)
        if self.kind is int:
            return check_int(self.name, value, lo, hi)
        return check_str(self.name, value)


def doc_field(default: Any, doc: str, lo: float | None = None, hi: float | None = None) -> Any:
    """A dataclass field with its doc and its inclusive bounds (None: unbounded)."""
    return field(default=default, metadata={"doc": doc, "lo": lo, "hi": hi})


_TYPES: dict[str, type[int] | type[float] | type[str]] = {"int": int, "float": float, "str": str}


def field_key(f: dataclasses.Field[Any]) -> Key:
    """The ``Key`` a ``doc_field`` describes (its type from the annotation)."""
    kind = _TYPES[str(f.type).removesuffix(" | None")]  # TOML has no None: a file sets a value or nothing
    return Key(f.name, kind, f.metadata["lo"], f.metadata["hi"], f.metadata["doc"])


def suggest(key: str, known: list[str]) -> str:
    """The fix for an unknown key: the nearest known one, else the list."""
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"


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
