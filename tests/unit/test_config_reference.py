"""docs/configuration.md is generated from the typed fields (controller/config/reference.py): the
committed file must be what the code generates, and every key the loader accepts must be in it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from controller.config import reference
from controller.config.classes_table import KEYS as CLASS_KEYS
from controller.config.load import _DICT_FIELDS, _TABLES
from controller.config.slo_table import KEYS as SLO_KEYS


def test_committed_reference_matches_the_code() -> None:
    committed = reference.DOC.read_text() if reference.DOC.is_file() else ""
    assert committed == reference.render(), (
        f"docs/configuration.md disagrees with the config fields: run `{reference.REGENERATE}` and commit it"
    )


def test_every_key_is_documented_once_per_table() -> None:
    text = reference.render()
    for name, cls in _TABLES.items():
        section = text.split(f"## `[{name}]`", 1)[1].split("\n## ", 1)[0]
        for f in dataclasses.fields(cls):
            if f.name not in _DICT_FIELDS:
                assert f"| `{f.name}` |" in section, (name, f.name)
    classes = text.split("## `[admission.classes.NAME]`", 1)[1].split("\n## ", 1)[0]
    assert all(f"| `{key}` |" in classes for key in CLASS_KEYS)
    slo = text.split("## `[slo]`", 1)[1].split("\n## ", 1)[0]
    assert all(f"| `{key}` |" in slo for key in SLO_KEYS)


def test_host_dependent_defaults_name_real_fields() -> None:
    for table, key in reference.HOST_DEPENDENT:
        assert key in {f.name for f in dataclasses.fields(_TABLES[table])}


def test_a_class_table_without_a_deadline_is_documented_with_the_deadline_it_gets() -> None:
    row = next(line for line in reference.render().splitlines() if line.startswith("| `queue_deadline_s` |"))
    assert row.startswith("| `queue_deadline_s` | `10.0` | `5.0` / `60.0` |")


def test_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    assert reference.main(["--check", "--out", str(out)]) == 1
    assert reference.main(["--out", str(out)]) == 0
    assert reference.main(["--check", "--out", str(out)]) == 0
