"""No setting of config.toml may be NaN or infinite: TOML accepts ``nan``, ``inf`` and ``-inf``, and a
NaN passes any range check written ``value < lo or value > hi``. The typed keys are found by walking
the tables' dataclass fields, so a float key added later is covered too.

The [engine] and [server] tables are checked against vLLM's parser: the first load pays for
importing vLLM (a few seconds, once).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from controller.admission.classes import PriorityClass
from controller.config.load import _TABLES, ConfigError, load_config, parse_config
from controller.config.slo_table import KEYS as SLO_KEYS
from controller.control.samplers import FakeHostSource
from controller.lifecycle.parts import build_parts
from controller.lifecycle.reload import Reloader
from tests.helpers import write_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "config.toml"
BASE: dict[str, Any] = tomllib.loads(DEFAULT.read_text())
NON_FINITE = [math.nan, math.inf, -math.inf]


def _float_keys() -> list[tuple[str, str]]:
    """(table, key) of every float field of every typed table, [slo] and a priority class."""
    keys = [
        (table, f.name)
        for table, cls in _TABLES.items()
        for f in dataclasses.fields(cls)
        if str(f.type) == "float"
    ]
    keys += [("slo", key) for key in SLO_KEYS]
    keys += [
        ("admission.classes.batch", f.name)
        for f in dataclasses.fields(PriorityClass)
        if str(f.type).startswith("float")
    ]
    return keys


FLOAT_KEYS = _float_keys()


def _with(path: str, key: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    table = data
    for name in path.split("."):
        table = table.setdefault(name, {})
    table[key] = value
    return data


def _errors(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(data, DEFAULT)
    return exc.value.errors


def test_every_table_has_float_keys_to_check() -> None:
    tables = {table for table, _ in FLOAT_KEYS}
    assert {"server", "admission", "control", "guard", "slo", "admission.classes.batch"} <= tables
    assert ("guard", "stall_timeout_s") in FLOAT_KEYS and ("server", "send_timeout_s") in FLOAT_KEYS


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("table", "key"), FLOAT_KEYS, ids=[f"{t}.{k}" for t, k in FLOAT_KEYS])
def test_a_non_finite_float_key_is_refused_naming_the_key(table: str, key: str, value: float) -> None:
    errors = _errors(_with(table, key, value))
    assert any(f"[{table}] {key} = {value!r}" in e for e in errors), errors


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("engine", "gpu_memory_utilization"),
        ("server", "uvicorn_keep_alive_s"),  # a free [server] key: a vLLM option or a near miss
        ("control.params", "margin"),
        ("control.params", "stale_after_s"),  # bounded above by nothing in the policy
    ],
)
def test_a_non_finite_free_form_value_is_refused_naming_the_key(table: str, key: str, value: float) -> None:
    errors = _errors(_with(table, key, value))
    assert any(e.startswith(f"[{table}] {key} = {value!r}: not a finite number") for e in errors), errors


def test_a_non_finite_value_nested_in_a_free_form_table_is_refused() -> None:
    errors = _errors(_with("control", "params", {"gains": {"kp": [1.0, math.nan]}}))
    assert any(e.startswith("[control.params] gains.kp[1] = nan: not a finite number") for e in errors)


async def test_a_reload_with_a_nan_stall_timeout_is_refused_and_the_old_config_stays(
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path / "config.toml", guard={"stall_timeout_s": 30.0})
    parts = build_parts(load_config(path), host_source=FakeHostSource(16 << 30))
    before = parts.config
    path.write_text(path.read_text().replace("stall_timeout_s = 30.0", "stall_timeout_s = nan"))
    assert "stall_timeout_s = nan" in path.read_text()
    result = await Reloader(parts).reload()
    assert result["ok"] is False
    assert any(e.startswith("[guard] stall_timeout_s = nan") for e in result["errors"])
    assert parts.config is before
    assert parts.guard.s.stall_timeout_s == 30.0 and parts.guard.stall.timeout_s == 30.0
