"""The configs the bench writes for the daemons it starts."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from controller.bench.servers import ServerSpec, daemon_config, load_base_config, to_toml
from controller.bench.targets import base_config
from controller.config.load import load_config
from tests.helpers import ROOT


def test_the_default_config_round_trips_with_its_nested_class_tables() -> None:
    base = load_base_config(ROOT / "config.toml")
    assert "classes" in base["admission"]  # [admission.classes.NAME]: tables two levels deep
    assert tomllib.loads(to_toml(base)) == base


def test_a_relative_model_folder_missing_beside_the_config_is_named_before_any_server_starts(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('[engine]\nmodel = "models/tiny"\n')
    with pytest.raises(FileNotFoundError, match="read from the config file's folder") as caught:
        load_base_config(path)
    assert str(tmp_path / "models/tiny") in str(caught.value)
    (tmp_path / "models/tiny").mkdir(parents=True)
    assert load_base_config(path)["engine"]["model"] == str((tmp_path / "models/tiny").resolve())


def test_a_daemon_config_written_for_a_server_loads_as_a_valid_config(tmp_path: Path) -> None:
    base = load_base_config(ROOT / "config.toml")
    spec = ServerSpec(name="static", kind="daemon", engine=dict(base["engine"]), admission={"limit": 8})
    path = tmp_path / "daemon.toml"
    path.write_text(to_toml(daemon_config(base, spec, 18000, 19000)))
    config = load_config(path)
    assert config.server.port == 18000 and config.admission.limit == 8
    assert [c.name for c in config.admission.classes] == ["interactive", "batch"]


def test_an_engine_model_override_is_a_path_from_where_the_bench_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's config is written elsewhere (the run's log dir), where a relative path means nothing."""
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(config=ROOT / "config.toml", engine=["model=models/tiny"], daemon=None)
    assert base_config(args)["engine"]["model"] == str(tmp_path / "models" / "tiny")
    args.engine = ["model=org/hub-name"]  # not a local dir: left for vLLM to resolve
    assert base_config(args)["engine"]["model"] == "org/hub-name"
