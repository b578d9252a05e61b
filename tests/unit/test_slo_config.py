"""[slo]: parsing, errors that name the fix, per-class resolution, the reload diff, check-config and
/state.

Loading a config imports vLLM (the [engine] names are checked against it): a few seconds, once.
"""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from controller.admission.classes import PriorityClass
from controller.config.diff import diff_config, merge_live
from controller.config.load import ConfigError, describe, load_config, parse_config
from controller.config.slo_table import wait_bounds
from policies.slo_targets import SloBound, SloTargets
from tests.helpers import write_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "config.toml"
BASE: dict[str, Any] = tomllib.loads(DEFAULT.read_text())


def document(slo: dict[str, Any] | None = None, **classes: dict[str, Any]) -> dict[str, Any]:
    """The default file with ``[slo]`` replaced (None: removed) and keys added to classes."""
    data = copy.deepcopy(BASE)
    data.pop("slo", None)
    if slo is not None:
        data["slo"] = slo
    for name, keys in classes.items():
        data["admission"]["classes"][name].update(keys)
    return data


def errors_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(data, DEFAULT)
    return exc.value.errors


# -- parsing and resolution ----------------------------------------------------------------------


def test_the_default_file_steers_to_its_slo() -> None:
    config = load_config(DEFAULT)
    bound = SloBound(5.0, 0.25)
    assert config.slo == SloTargets(bound, (("interactive", bound), ("batch", bound)))
    assert config.slo.for_class("interactive") == (5.0, 0.25)
    ttft_s, tpot_s = config.slo.for_class("batch")  # unpacks as a pair
    assert (ttft_s, tpot_s) == (5.0, 0.25)


def test_without_slo_there_is_no_slo() -> None:
    config = parse_config(document(None), DEFAULT)
    assert config.slo is None
    assert describe(config)["slo"] is None


def test_a_class_overrides_either_bound() -> None:
    data = document({"ttft_s": 1, "tpot_s": 0.05}, batch={"slo_ttft_s": 30, "slo_tpot_s": 0.2})
    data["admission"]["classes"]["interactive"]["slo_tpot_s"] = 0.04
    slo = parse_config(data, DEFAULT).slo
    assert slo is not None
    assert slo.for_class("interactive") == SloBound(1.0, 0.04)
    assert slo.for_class("batch") == SloBound(30.0, 0.2)
    assert slo.for_class("removed_by_reload") == SloBound(1.0, 0.05)  # the table's
    assert slo.tightest == SloBound(1.0, 0.04)
    assert isinstance(slo.for_class("batch").ttft_s, float)


def test_the_wait_bound_is_the_shorter_of_deadline_and_ttft() -> None:
    slo = SloTargets(
        SloBound(2.5, 0.07), (("interactive", SloBound(2.5, 0.07)), ("fast", SloBound(0.5, 0.07)))
    )
    classes = [
        PriorityClass("interactive", queue_deadline_s=5.0),
        PriorityClass("fast", queue_deadline_s=0.2),
    ]
    assert wait_bounds(slo, classes) == {"interactive": 2.5, "fast": 0.2}


@pytest.mark.parametrize(
    ("slo", "expected"),
    [
        (
            {"ttft_s": 2.5},
            "[slo] tpot_s is missing: a request is good when both ttft_s and tpot_s hold; set it. "
            "Longest mean time per output token of a good request, in seconds.",
        ),
        (
            {"ttft_s": -1, "tpot_s": 0.07},
            "[slo] ttft_s = -1: out of range; use a value in [0.001, 86400]. Longest time to first token "
            "of a good request, queueing included, in seconds.",
        ),
        (
            {"ttft_s": 2.5, "tpot_s": 0},
            "[slo] tpot_s = 0: out of range; use a value in [0.0001, 60]. Longest mean time per output "
            "token of a good request, in seconds.",
        ),
        (
            {"ttft_s": "2.5s", "tpot_s": 0.07},
            "[slo] ttft_s = '2.5s': must be float. Longest time to first token of a good request, "
            "queueing included, in seconds.",
        ),
        ({"ttft_s": True, "tpot_s": 0.07}, "[slo] ttft_s = True: must be float. "),
        ({"ttft_s": 2.5, "tpot_s": 0.07, "tpot": 1}, "[slo] unknown key 'tpot': did you mean 'tpot_s'?"),
    ],
)
def test_slo_errors_name_the_key_the_value_and_the_fix(slo: dict[str, Any], expected: str) -> None:
    errors = errors_of(document(slo))
    assert len(errors) == 1
    assert errors[0].startswith(expected)


def test_slo_that_is_not_a_table() -> None:
    data = document(None)
    data["slo"] = 2.5
    assert errors_of(data) == ["slo = 2.5: must be a table; write [slo] on a line of its own"]


def test_a_class_override_needs_the_table() -> None:
    assert errors_of(document(None, batch={"slo_ttft_s": 30.0})) == [
        "[admission.classes.batch] slo_ttft_s = 30.0: a class SLO overrides the [slo] table, and there is "
        "none; add [slo] with ttft_s and tpot_s (the bound of the other classes), or drop the key"
    ]


def test_a_class_override_is_range_checked() -> None:
    errors = errors_of(document({"ttft_s": 1, "tpot_s": 0.05}, batch={"slo_tpot_s": 0.0}))
    assert errors == [
        "[admission.classes.batch] slo_tpot_s = 0.0: out of range; use a value in [0.0001, 60]. This "
        "class's time-per-output-token bound, overriding [slo] tpot_s."
    ]


def test_a_cost_profile_must_load() -> None:
    data = document({"ttft_s": 1, "tpot_s": 0.05})
    data["control"]["cost_profile"] = "cpu-tny"
    (error,) = errors_of(data)
    assert error.startswith("[control] cost_profile = 'cpu-tny': unknown profile 'cpu-tny': use one of ")
    data["control"]["cost_profile"] = "cpu-tiny"
    assert parse_config(data, DEFAULT).control.cost_profile == "cpu-tiny"


# -- shown, and live on reload --------------------------------------------------------------------


def test_check_config_shows_the_resolved_slo(capsys: pytest.CaptureFixture[str]) -> None:
    from controller.cli import main

    assert main(["check-config", "--config", str(DEFAULT)]) == 0
    shown = json.loads(capsys.readouterr().out)["slo"]
    assert shown == {
        "ttft_s": 5.0,
        "tpot_s": 0.25,
        "classes": {
            "interactive": {"ttft_s": 5.0, "tpot_s": 0.25, "wait_bound_s": 5.0},
            "batch": {"ttft_s": 5.0, "tpot_s": 0.25, "wait_bound_s": 5.0},
        },
    }


def test_the_slo_is_live_on_reload() -> None:
    old = load_config(DEFAULT)
    new = parse_config(document({"ttft_s": 1.0, "tpot_s": 0.25}, batch={"slo_ttft_s": 20.0}), DEFAULT)
    diff = diff_config(old, new)
    assert diff.live == {"admission": ["classes"], "slo": ["classes", "ttft_s"]}
    assert diff.pending == {}
    merged = merge_live(old, new)
    assert merged.slo is not None and merged.slo.for_class("batch") == SloBound(20.0, 0.25)
    gone = diff_config(old, parse_config(document(None), DEFAULT))
    assert gone.live == {"slo": ["classes", "tpot_s", "ttft_s"]} and gone.pending == {}


async def test_reload_swaps_the_slo_in_and_state_shows_it(tmp_path: Path) -> None:
    from controller.admin.status import state
    from controller.lifecycle.parts import build_parts
    from controller.lifecycle.reload import Reloader

    path = write_config(tmp_path / "config.toml", slo={"ttft_s": 2.5, "tpot_s": 0.07})
    parts = build_parts(load_config(path))
    assert state(parts)["slo"]["ttft_s"] == 2.5
    ports = {"server": {"port": parts.config.server.port}, "admin": {"port": parts.config.admin.port}}
    write_config(path, **ports, slo={"ttft_s": 1.5, "tpot_s": 0.05})
    result = await Reloader(parts).reload()
    assert result["ok"] and result["changed"] == {"slo": ["classes", "tpot_s", "ttft_s"]}
    assert result["pending"] == {}
    shown = state(parts)
    assert (shown["slo"]["ttft_s"], shown["slo"]["tpot_s"]) == (1.5, 0.05)
    assert shown["config"]["slo"] == shown["slo"]
