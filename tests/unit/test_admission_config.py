"""[admission] aging_s and [admission.classes]: parsing, validation (every error in one pass, each
naming the key and the fix) and live reload (an invalid classes table keeps the old config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.admission.classes import DEFAULT_CLASSES, PriorityClass
from controller.config.classes_table import parse_classes
from controller.config.load import ConfigError, load_config
from controller.lifecycle.daemon import Daemon
from tests.helpers import write_config


def errors_of(raw: Any) -> list[str]:
    errors: list[str] = []
    parse_classes(raw, errors)
    return errors


def test_default_classes_split_at_priority_zero() -> None:
    interactive, batch = DEFAULT_CLASSES
    assert (interactive.name, interactive.min_priority, interactive.max_priority) == ("interactive", None, 0)
    assert (batch.name, batch.min_priority, batch.max_priority) == ("batch", 1, None)


def test_classes_are_ordered_by_their_priority_range() -> None:
    errors: list[str] = []
    classes = parse_classes(
        {
            "bulk": {"min_priority": 10, "queue_deadline_s": 600},
            "chat": {"max_priority": -1, "max_queue": 32, "queue_deadline_s": 1.5, "reserved_share": 0.25},
            "api": {"min_priority": 0, "max_priority": 9},
        },
        errors,
    )
    assert errors == []
    assert [c.name for c in classes] == ["chat", "api", "bulk"]
    assert classes[0] == PriorityClass("chat", None, -1, 32, 1.5, 0.25)
    assert classes[2].queue_deadline_s == 600.0 and isinstance(classes[2].queue_deadline_s, float)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"a": {"max_priority": 0, "max_queu": 3}, "b": {"min_priority": 1}},
            ["[admission.classes.a] unknown key 'max_queu': did you mean 'max_queue'?"],
        ),
        (
            {"a": {"max_priority": 0, "queue_deadline_s": "5s"}, "b": {"min_priority": 1}},
            ["[admission.classes.a] queue_deadline_s = '5s': must be float"],
        ),
        (
            {"a": {"max_priority": 0, "reserved_share": 1.5}, "b": {"min_priority": 1}},
            ["[admission.classes.a] reserved_share = 1.5: out of range; use a value in [0.0, 1.0]"],
        ),
        (
            {"a": {"max_priority": 0}, "b": {"min_priority": 2}},
            [
                "[admission.classes.a] and [admission.classes.b]: their priority ranges must meet "
                "without gap or overlap; set b.min_priority = a.max_priority + 1"
            ],
        ),
        (
            {"a": {"max_priority": 5}, "b": {"min_priority": 1}},
            ["[admission.classes.a] and [admission.classes.b]: their priority ranges must meet"],
        ),
        (
            {"a": {"min_priority": -5, "max_priority": 0}, "b": {"min_priority": 1}},
            ["[admission.classes.a] min_priority = -5: lower priorities would have no class"],
        ),
        (
            {"a": {"max_priority": 0}, "b": {"min_priority": 1, "max_priority": 99}},
            ["[admission.classes.b] max_priority = 99: higher priorities would have no class"],
        ),
        (
            {"a": {"min_priority": 3, "max_priority": 1}},
            ["[admission.classes.a] min_priority = 3 > max_priority = 1: swap them"],
        ),
        (
            {
                "a": {"max_priority": 0, "reserved_share": 0.6},
                "b": {"min_priority": 1, "reserved_share": 0.6},
            },
            ["[admission.classes] reserved_share adds up to 1.2: the shares must total at most 1"],
        ),
        ({"Chat Users": {}}, ["[admission.classes.Chat Users]: class names are metric labels"]),
        ({"a": 3}, ["[admission.classes.a]: must be a table of min_priority, max_priority"]),
        ({}, ["[admission] classes must be tables: write [admission.classes.NAME] per class"]),
    ],
)
def test_bad_classes_name_the_key_and_the_fix(raw: Any, expected: list[str]) -> None:
    errors = errors_of(raw)
    assert len(errors) == len(expected), errors
    for error, start in zip(errors, expected, strict=True):
        assert error.startswith(start), error


def test_a_single_class_may_cover_every_priority() -> None:
    assert errors_of({"all": {"queue_deadline_s": 30}}) == []


def test_config_file_errors_in_one_pass(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "c.toml",
        admission={"limit": 4, "aging_s": -1, "classes": {}},
    )
    text = path.read_text().replace(
        "[admission.classes]\n",
        "[admission.classes.a]\nmax_priority = 0\nmax_queue = -1\n[admission.classes.b]\nmin_priority = 5\n",
    )
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert [e.split(":")[0] for e in exc.value.errors] == [
        "[admission] aging_s = -1",
        "[admission.classes.a] max_queue = -1",
        "[admission.classes.a] and [admission.classes.b]",
    ]


def _classes_config(path: Path, interactive_deadline: float, bad: bool = False) -> Path:
    path = write_config(path, admission={"limit": 4, "max_queue": 64, "aging_s": 3.0})
    extra = (
        "[admission.classes.interactive]\nmax_priority = 0\n"
        f"queue_deadline_s = {interactive_deadline}\nreserved_share = 0.25\n"
        f"[admission.classes.batch]\nmin_priority = {5 if bad else 1}\nqueue_deadline_s = 20.0\n"
    )
    path.write_text(path.read_text() + extra)
    return path


async def test_reload_applies_classes_live_and_keeps_them_on_error(tmp_path: Path) -> None:
    path = _classes_config(tmp_path / "c.toml", 2.0)
    daemon = Daemon(load_config(path), install_signals=False)
    assert [(c.name, c.queue_deadline_s) for c in daemon.parts.gate.classes] == [
        ("interactive", 2.0),
        ("batch", 20.0),
    ]
    assert daemon.parts.gate.aging_s == 3.0

    _classes_config(path, 7.5)
    result = await daemon.reloader.reload()
    assert result["ok"] is True and result["changed"] == {"admission": ["classes"]}
    assert daemon.parts.gate.classes[0].queue_deadline_s == 7.5
    assert daemon.config.admission.classes[0].reserved_share == 0.25

    _classes_config(path, 1.0, bad=True)  # a gap between 0 and 5: the whole file is refused
    result = await daemon.reloader.reload()
    assert result["ok"] is False
    assert any("priority ranges must meet" in e for e in result["errors"])
    assert daemon.parts.gate.classes[0].queue_deadline_s == 7.5
    assert (
        daemon.parts.metrics.registry.get_sample_value("autopilot_config_reloads_total", {"result": "error"})
        == 1.0
    )
