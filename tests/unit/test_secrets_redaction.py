"""A secret never leaves the daemon: not through an engine restart's record (/state, the log), not
through a config error (the log, the /reload answer, check-config), not through the command line's
overlay kept for reloads."""

from __future__ import annotations

import argparse
import copy
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from controller.admin.status import state
from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.bench.servers import to_toml
from controller.cli import _check_config
from controller.clock import FakeClock
from controller.config.cli_layer import serve_config
from controller.config.load import ConfigError, GuardConfig, describe, load_config, parse_config
from controller.config.secrets import REDACTED, redact, scrub
from controller.control.samplers import FakeHostSource
from controller.lifecycle import guard as guard_module
from controller.lifecycle import reload as reload_module
from controller.lifecycle.guard import Guard
from controller.lifecycle.parts import Parts, build_parts
from controller.lifecycle.reload import Reloader
from tests.helpers import settle, write_config

HF_TOKEN = "hf_secret_token_123"


class Recorder:
    """A structlog logger that keeps every event and its fields."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _record(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    info = warning = error = critical = _record

    def text(self) -> str:
        return json.dumps(self.events, default=str)


class FakeEngine:
    """An ``EngineControl`` whose restarts always build; it keeps the overrides it was given."""

    memory_knob = "kv_cache_memory_bytes"
    died_out_of_memory = False
    dead = False

    def __init__(self) -> None:
        self.restarts: list[dict[str, Any]] = []

    def memory_settings(self) -> dict[str, Any]:
        return {"kv_cache_memory_bytes": 64 << 20}

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.restarts.append(overrides)

    async def abort_in_flight(self, reason: str) -> int:
        return 0

    def mark_failed(self, reason: str) -> None:
        self.dead = True


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(guard_module, "log", recorder)
    monkeypatch.setattr(reload_module, "log", recorder)
    return recorder


def parts_for(tmp_path: Path, **tables: dict[str, Any]) -> Parts:
    path = write_config(tmp_path / "config.toml", **tables)
    return build_parts(load_config(path), host_source=FakeHostSource(16 << 30))


async def test_a_restarts_record_and_log_show_no_secret_override(logs: Recorder) -> None:
    engine = FakeEngine()
    gate = AdmissionGate(4, 16, [PriorityClass("default", 0)], aging_s=0.0)
    guard = Guard(GuardConfig(), gate, engine, lambda _r, _d: None, FakeClock(), lambda: None)
    await guard.restart("config_reload", {"hf_token": HF_TOKEN, "max_model_len": 1024}, drain=False)
    assert engine.restarts == [{"hf_token": HF_TOKEN, "max_model_len": 1024}]  # the engine gets it
    assert guard.last_restart is not None
    assert guard.last_restart["overrides"] == {"hf_token": REDACTED, "max_model_len": 1024}
    assert HF_TOKEN not in logs.text() and "engine_restarted" in logs.text()


async def test_a_reload_that_changes_the_hf_token_shows_it_nowhere(tmp_path: Path, logs: Recorder) -> None:
    p = parts_for(tmp_path, engine={"restart_on_reload": True})
    engine = FakeEngine()
    p.guard.engine = engine
    ports = {"server": {"port": p.config.server.port}, "admin": {"port": p.config.admin.port}}
    write_config(p.config.path, **ports, engine={"restart_on_reload": True, "hf_token": HF_TOKEN})
    result = await Reloader(p).reload()
    assert result["ok"] is True and result["engine_restart"] == {"hf_token": REDACTED}
    for _ in range(20):
        await settle()
    assert engine.restarts == [{"hf_token": HF_TOKEN}]
    assert p.config.engine["hf_token"] == HF_TOKEN  # the config in force follows the engine
    shown = json.dumps(state(p), default=str)
    assert HF_TOKEN not in shown and HF_TOKEN not in logs.text()
    assert p.guard.last_restart is not None and p.guard.last_restart["overrides"] == {"hf_token": REDACTED}


# -- config errors and the command line's overlay ----------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "config.toml"
BASE: dict[str, Any] = tomllib.loads(DEFAULT.read_text())


def _doc(**tables: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    for name, values in tables.items():
        data.setdefault(name, {}).update(values)
    return data


@pytest.mark.parametrize(
    ("tables", "secret", "where"),
    [
        ({"server": {"api_key": 12345}}, "12345", "[server] api_key"),
        ({"admin": {"token": 987654}}, "987654", "[admin] token"),
        ({"engine": {"hf_token": ["hf_in_a_list_77"]}}, "hf_in_a_list_77", "[engine] hf_token"),
        ({"server": {"api_key": ["good-key-1", 4242]}}, "4242", "[server] api_key"),
    ],
)
def test_a_config_error_names_a_secret_key_but_not_its_value(
    tables: dict[str, Any], secret: str, where: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(_doc(**tables), DEFAULT)
    assert any(e.startswith(where) for e in exc.value.errors), exc.value.errors
    assert secret not in str(exc.value) and REDACTED in str(exc.value)


def test_a_secret_is_kept_out_of_the_other_keys_errors_too() -> None:
    data = _doc(server={"api_key": "sk-live-abcdef"}, admission={"limit": "sk-live-abcdef"})
    with pytest.raises(ConfigError) as exc:
        parse_config(data, DEFAULT)
    assert any(e.startswith("[admission] limit = '<redacted>'") for e in exc.value.errors)


async def test_a_reload_refused_for_a_secret_answers_and_logs_no_value(
    tmp_path: Path, logs: Recorder
) -> None:
    p = parts_for(tmp_path)
    ports = {"server": {"port": p.config.server.port}, "admin": {"port": p.config.admin.port}}
    write_config(p.config.path, **{**ports, "server": {**ports["server"], "api_key": 12345}})
    result = await Reloader(p).reload()
    assert result["ok"] is False and any(e.startswith("[server] api_key") for e in result["errors"])
    assert "12345" not in json.dumps(result) and "12345" not in logs.text()


def test_check_config_prints_no_secret_of_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.toml"
    data = _doc(admin={"token": 31337})
    data["engine"]["model"] = str(ROOT / "models" / "tiny")
    path.write_text(to_toml(data))
    with pytest.raises(SystemExit) as exited:
        _check_config(argparse.Namespace(config=path))
    assert exited.value.code != 0
    captured = capsys.readouterr()
    assert "[admin] token" in captured.out + captured.err and "31337" not in captured.out + captured.err


def test_a_json_option_from_the_command_line_is_shown_with_its_secrets_redacted() -> None:
    extra = {"aws_secret_access_key": "AKIA-very-secret", "region": "eu-west-1"}
    transfer = json.dumps({"kv_connector": "X", "kv_role": "kv_both", "kv_connector_extra_config": extra})
    config = serve_config([str(ROOT / "models" / "tiny"), "--kv-transfer-config", transfer])
    assert "AKIA-very-secret" in config.overlay["engine"]["kv_transfer_config"]  # a reload lays it again
    shown = json.dumps(describe(config))
    assert "AKIA-very-secret" not in shown and "eu-west-1" in shown


def test_redact_looks_inside_json_text_and_leaves_other_text_alone() -> None:
    assert redact({"opt": '{"token": "t0ps3cret", "n": 1}'}) == {"opt": '{"token": "<redacted>", "n": 1}'}
    assert redact({"opt": '{"n": 1}'}) == {"opt": '{"n": 1}'}  # nothing to hide: the text as it was
    assert redact({"opt": "{not json"}) == {"opt": "{not json"}


def test_a_urls_user_and_password_are_redacted_under_any_key() -> None:
    shown = redact(
        {
            "model": "https://user:pw123@models.internal/llama",
            "note": "mirror at s3+http://AKIAXYZ:s3cr3t@minio:9000/bucket, see http://plain.host/x@y",
        }
    )
    assert shown["model"] == f"https://{REDACTED}@models.internal/llama"
    assert "s3cr3t" not in shown["note"] and "AKIAXYZ" not in shown["note"]
    assert f"s3+http://{REDACTED}@minio:9000/bucket" in shown["note"]
    assert "http://plain.host/x@y" in shown["note"]  # an @ past the host is no user: left alone


def test_credentials_auth_and_url_passwords_inside_a_json_option_are_redacted() -> None:
    extra = {
        "remote_url": "redis://:hunter2@redis:6379",
        "credentials": "s3cr3t-credential",
        "auth": "Basic dXNlcjpwYXNz",
        "region": "eu-west-1",
    }
    transfer = json.dumps({"kv_connector": "X", "kv_role": "kv_both", "kv_connector_extra_config": extra})
    config = serve_config([str(ROOT / "models" / "tiny"), "--kv-transfer-config", transfer])
    shown = json.dumps(describe(config))
    for secret in ("hunter2", "s3cr3t-credential", "dXNlcjpwYXNz"):
        assert secret not in shown
    assert "eu-west-1" in shown and "redis:6379" in shown


def test_a_switch_named_like_a_secret_is_shown_as_it_is() -> None:
    assert redact({"allow_credentials": True, "auth": False}) == {"allow_credentials": True, "auth": False}
    assert redact({"max_num_batched_tokens": 8192}) == {"max_num_batched_tokens": 8192}


def test_a_config_error_quotes_no_urls_password() -> None:
    data = _doc(
        engine={"model": "https://user:pw-9876@models.internal/llama"}, admission={"limit": "pw-9876"}
    )
    errors = scrub(
        ["[engine] model 'https://user:pw-9876@models.internal/llama' not found", "limit = 'pw-9876'"], data
    )
    assert not any("pw-9876" in e for e in errors) and "models.internal/llama" in errors[0]
