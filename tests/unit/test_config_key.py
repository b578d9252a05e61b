"""One config key (``controller/config/fields.Key``) checks a value's type, finiteness, range and
choices, and its error names the table, the key, the value, the fix and the key's doc; the checks are
the ones a constructor parameter passes (``policies/common.py``)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from controller.config.fields import Key, field_key
from controller.config.load import ControlConfig
from policies.base import PolicyError
from policies.common import check_float

TICK = Key("tick_s", float, 0.05, 3600, "Tick length.")
HISTORY = Key("history", int, 1, 10_000, "Decisions kept.")
ORDER = Key("order", str, doc="Who goes first.", choices=("arrival", "shortest"))
POLICY = Key("policy", str, doc="A policy name.")


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (TICK, 2, []),
        (TICK, 0.05, []),
        (TICK, "1", ["[control] tick_s = '1': must be float. Tick length."]),
        (TICK, True, ["[control] tick_s = True: must be float. Tick length."]),
        (
            TICK,
            math.nan,
            ["[control] tick_s = nan: not a finite number; use a value in [0.05, 3600]. Tick length."],
        ),
        (
            TICK,
            -math.inf,
            ["[control] tick_s = -inf: not a finite number; use a value in [0.05, 3600]. Tick length."],
        ),
        (
            TICK,
            3600.5,
            ["[control] tick_s = 3600.5: out of range; use a value in [0.05, 3600]. Tick length."],
        ),
        (HISTORY, 10_000, []),
        (HISTORY, 1.0, ["[control] history = 1.0: must be int. Decisions kept."]),
        (HISTORY, 0, ["[control] history = 0: out of range; use a value in [1, 10000]. Decisions kept."]),
        (ORDER, "shortest", []),
        (
            ORDER,
            "longest",
            ["[control] order = 'longest': must be one of 'arrival', 'shortest'. Who goes first."],
        ),
        (
            ORDER,
            ["arrival"],
            ["[control] order = ['arrival']: must be one of 'arrival', 'shortest'. Who goes first."],
        ),
        (POLICY, "slo", []),
        (POLICY, 3, ["[control] policy = 3: must be str. A policy name."]),
    ],
)
def test_a_key_checks_type_finiteness_range_and_choices(key: Key, value: object, expected: list[str]) -> None:
    assert key.check("control", value) == expected


def test_a_float_key_holds_a_toml_integer_as_a_float() -> None:
    assert TICK.typed(2) == 2.0 and isinstance(TICK.typed(2), float)
    assert HISTORY.typed(2) == 2 and isinstance(HISTORY.typed(2), int)


def test_a_table_field_is_the_key_its_metadata_describes() -> None:
    fields = {f.name: f for f in dataclasses.fields(ControlConfig)}
    assert field_key(fields["tick_s"]) == Key("tick_s", float, 0.05, 3600, fields["tick_s"].metadata["doc"])
    assert field_key(fields["tolerance"]).kind is float  # "float | None": a file sets a float or nothing
    assert field_key(fields["policy"]) == Key("policy", str, None, None, fields["policy"].metadata["doc"])


def test_a_key_and_a_constructor_parameter_fail_with_one_message() -> None:
    with pytest.raises(PolicyError) as exc:
        check_float("tick_s", 0.01, 0.05, 3600)
    assert TICK.check("control", 0.01) == [f"[control] {exc.value}. {TICK.doc}"]
