"""Secrets are never shown, and the control plane never listens beyond loopback without a token.

``describe`` is what /state and check-config print; the reload diff compares the real values, so a
changed key is still seen as a change.
"""

from __future__ import annotations

import argparse
import copy
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from controller.bench.servers import to_toml
from controller.cli import _check_config
from controller.config.diff import diff_config
from controller.config.load import ConfigError, describe, parse_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "config.toml"
BASE: dict[str, Any] = tomllib.loads(DEFAULT.read_text())
API_KEY, TOKEN = "secret-key-42", "admin-token-7"


def _doc(**tables: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    for name, values in tables.items():
        data.setdefault(name, {}).update(values)
    return data


def _with_secrets(**tables: dict[str, Any]) -> dict[str, Any]:
    return _doc(server={"api_key": API_KEY}, admin={"token": TOKEN}, **tables)


def test_describe_shows_secrets_as_redacted() -> None:
    shown = describe(parse_config(_with_secrets(engine={"hf_token": "hf_abc"}), DEFAULT))
    assert shown["server"]["vllm"]["api_key"] == "<redacted>"
    assert shown["admin"]["token"] == "<redacted>"
    assert shown["engine"]["hf_token"] == "<redacted>"
    text = json.dumps(shown, default=str)
    assert API_KEY not in text and TOKEN not in text and "hf_abc" not in text


def test_describe_shows_an_unset_token_as_empty() -> None:
    assert describe(parse_config(_doc(), DEFAULT))["admin"]["token"] == ""


def test_check_config_prints_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    data = _with_secrets()
    data["engine"]["model"] = str(ROOT / "models" / "smollm2")
    path.write_text(to_toml(data))
    assert _check_config(argparse.Namespace(config=path)) == 0
    out = capsys.readouterr().out
    assert API_KEY not in out and TOKEN not in out
    assert '"api_key": "<redacted>"' in out


def test_reload_diff_still_sees_a_changed_secret() -> None:
    old = parse_config(_with_secrets(), DEFAULT)
    new = parse_config(_doc(server={"api_key": "other"}, admin={"token": "other"}), DEFAULT)
    assert diff_config(old, new).pending == {"admin": ["token"], "server": ["vllm"]}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-box.example"])
def test_control_plane_beyond_loopback_needs_a_token(host: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(_doc(admin={"host": host}), DEFAULT)
    assert exc.value.errors == [
        f"[admin] host = {host!r}: the control plane would answer /state and /reload beyond this "
        'machine without a token; set [admin] token, or host = "127.0.0.1"'
    ]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_control_plane_on_loopback_needs_no_token(host: str) -> None:
    assert parse_config(_doc(admin={"host": host}), DEFAULT).admin.host == host


def test_control_plane_beyond_loopback_with_a_token_loads() -> None:
    assert parse_config(_doc(admin={"host": "0.0.0.0", "token": TOKEN}), DEFAULT).admin.token == TOKEN


def test_install_steps_keep_the_config_from_other_users() -> None:
    steps = (ROOT / "systemd" / "README.md").read_text()
    config_lines = [ln for ln in steps.splitlines() if ln.startswith("install") and "config.toml" in ln]
    assert config_lines and all("-m 0640" in line and "-g vllm-autopilot" in line for line in config_lines)
