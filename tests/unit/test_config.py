"""controller/config/load.py: the default file loads; every mistake names the key, the value and the fix.

The [engine] and [server] names are checked against vLLM's own argument parser, so the first test in
this file pays for importing vLLM (a few seconds, once).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from controller.config.load import (
    AdminConfig,
    AdmissionConfig,
    ConfigError,
    ControlConfig,
    ServerConfig,
    describe,
    load_config,
    parse_config,
)
from policies.base import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ADMISSION = {
    "limit": 64,
    "max_queue": 1024,
    "aging_s": 10.0,
    "most_urgent_priority": -(2**63),
    "default_priority": 0,
    "ttft_wait_share": 0.8,
}
DEFAULT = ROOT / "config.toml"
BASE: dict[str, Any] = tomllib.loads(DEFAULT.read_text())


def with_changes(**tables: dict[str, Any]) -> dict[str, Any]:
    """The default document with keys added or replaced per table."""
    data = copy.deepcopy(BASE)
    for name, values in tables.items():
        data.setdefault(name, {}).update(values)
    return data


def errors_of(data: dict[str, Any], path: Path = DEFAULT) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(data, path)
    assert str(exc.value) == "\n".join(exc.value.errors)
    return exc.value.errors


def test_default_config_loads() -> None:
    config = load_config(DEFAULT)
    assert config.path == DEFAULT
    assert config.engine["model"] == str(ROOT / "models" / "smollm2")  # relative to the file, not the cwd
    assert config.max_num_seqs == 64
    assert config.server == ServerConfig(host="127.0.0.1", port=8000, shutdown_timeout_s=30.0, vllm={})
    assert config.admin == AdminConfig(host="127.0.0.1", port=9400)
    assert config.admission == AdmissionConfig(limit=64, max_queue=1024, aging_s=10.0)
    assert config.control == ControlConfig(
        tick_s=1.0, policy="slo", window_s=10.0, history=50, params={}, warmup_s=20.0
    )  # no cost_profile: the warm-up fits the step-cost model at startup
    described = describe(config)
    assert {k: v for k, v in described["admission"].items() if k != "classes"} == DEFAULT_ADMISSION
    assert described["engine"]["max_num_seqs"] == 64


@pytest.mark.parametrize(
    ("table", "key", "expected"),
    [
        ("admission", "limt", "[admission] unknown key 'limt': did you mean 'limit'?"),
        ("admission", "max_queu", "[admission] unknown key 'max_queu': did you mean 'max_queue'?"),
        (
            "admission",
            "xyzzy",
            "[admission] unknown key 'xyzzy': known keys: "
            "aging_s, default_priority, limit, max_queue, most_urgent_priority, ttft_wait_share",
        ),
        ("admin", "prot", "[admin] unknown key 'prot': did you mean 'port'?"),
        ("control", "polcy", "[control] unknown key 'polcy': did you mean 'policy'?"),
        ("control", "tick_second", "[control] unknown key 'tick_second': did you mean 'tick_s'?"),
        ("control", "histroy", "[control] unknown key 'histroy': did you mean 'history'?"),
        (
            "engine",
            "max_num_seq",
            "[engine] unknown key 'max_num_seq': not a vLLM engine argument; did you mean 'max_num_seqs'?",
        ),
        (
            "server",
            "prot",  # vLLM's parser does not know our own [server] keys: the hint must still name them
            "[server] unknown key 'prot': not a vLLM server option; see `vllm serve --help` for the names; "
            "or did you mean 'port'?",
        ),
        (
            "server",
            "api_kye",
            "[server] unknown key 'api_kye': not a vLLM server option; did you mean 'api_key'?",
        ),
    ],
)
def test_misspelt_key_names_it_and_suggests_the_fix(table: str, key: str, expected: str) -> None:
    assert errors_of(with_changes(**{table: {key: 1}})) == [expected]


def test_vllm_front_end_options_pass_through_server() -> None:
    config = parse_config(with_changes(server={"api_key": "k", "grpc_port": 9001}), DEFAULT)
    assert config.server.vllm == {"api_key": "k", "grpc_port": 9001}  # grpc_port is close to port, but valid


@pytest.mark.parametrize(
    ("table", "key", "value", "expected_start"),
    [
        ("admission", "limit", 0, "[admission] limit = 0: out of range; use a value in [1, 100000]."),
        (
            "admission",
            "max_queue",
            -1,
            "[admission] max_queue = -1: out of range; use a value in [0, 1000000].",
        ),
        ("server", "port", 70000, "[server] port = 70000: out of range; use a value in [1, 65535]."),
        ("admin", "port", 0, "[admin] port = 0: out of range; use a value in [1, 65535]."),
        (
            "server",
            "shutdown_timeout_s",
            3600.5,
            "[server] shutdown_timeout_s = 3600.5: out of range; use a value in [0, 3600].",
        ),
        (
            "control",
            "tick_s",
            0.01,
            "[control] tick_s = 0.01: out of range; use a value in [0.05, 3600].",
        ),
        (
            "control",
            "window_s",
            0.1,
            "[control] window_s = 0.1: out of range; use a value in [0.5, 3600].",
        ),
        ("control", "history", 0, "[control] history = 0: out of range; use a value in [1, 10000]."),
    ],
)
def test_out_of_range_names_key_value_and_range(
    table: str, key: str, value: Any, expected_start: str
) -> None:
    errors = errors_of(with_changes(**{table: {key: value}}))
    assert len(errors) == 1
    assert errors[0].startswith(expected_start), errors[0]


@pytest.mark.parametrize(
    ("table", "key", "value", "expected_start"),
    [
        ("admission", "limit", "64", "[admission] limit = '64': must be int."),
        ("admission", "limit", True, "[admission] limit = True: must be int."),
        ("admission", "limit", 1.5, "[admission] limit = 1.5: must be int."),
        ("control", "tick_s", "1", "[control] tick_s = '1': must be float."),
        ("control", "tick_s", False, "[control] tick_s = False: must be float."),
        ("control", "policy", 3, "[control] policy = 3: must be str."),
        ("server", "host", 127, "[server] host = 127: must be str."),
        ("control", "params", 3, "[control] params must be a table: write [control.params]"),
    ],
)
def test_wrong_type_names_key_value_and_type(table: str, key: str, value: Any, expected_start: str) -> None:
    errors = errors_of(with_changes(**{table: {key: value}}))
    assert len(errors) == 1
    assert errors[0].startswith(expected_start), errors[0]


def test_int_is_accepted_where_a_float_is_expected() -> None:
    config = parse_config(with_changes(control={"tick_s": 2}), DEFAULT)
    assert config.control.tick_s == 2.0
    assert isinstance(config.control.tick_s, float)


# -- keys in the wrong place ------------------------------------------------------------------------


def test_an_unknown_policy_parameter_is_an_error_naming_it_and_the_policys_parameters() -> None:
    data = with_changes(control={"policy": "static", "params": {"batch_cap": 24}})
    assert errors_of(data) == [
        "[control] policy = 'static': [control.params] for policy 'static': unknown parameter "
        "'batch_cap': its parameters: admission_limit, max_num_active_seqs, max_num_scheduled_tokens, preset"
    ]


@pytest.mark.parametrize(("key", "table"), [("reverse_after_s", "control"), ("ttft_wait_share", "admission")])
def test_a_tables_key_under_control_params_is_an_error_naming_its_table(key: str, table: str) -> None:
    assert errors_of(with_changes(control={"policy": "slo", "params": {key: 0.5}})) == [
        f"[control.params] {key} is not a parameter of policy 'slo' but a key of [{table}], for every "
        f"policy: write it in [{table}]"
    ]


@pytest.mark.parametrize("table", ["admission", "control", "server"])
def test_a_table_that_is_not_a_table(table: str) -> None:
    data = copy.deepcopy(BASE)
    data[table] = 5
    assert errors_of(data) == [f"{table} = 5: must be a table; write [{table}] on a line of its own"]


def test_engine_that_is_not_a_table() -> None:
    errors = errors_of({"engine": 5})
    assert errors == [
        "engine = 5: must be a table; write [engine] on a line of its own",
        "[engine] model is missing: set it to a model path or Hugging Face name",
    ]


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ("contrl", "unknown table [contrl]: did you mean 'control'?"),
        ("xyzzy", "unknown table [xyzzy]: known keys: admin, admission, control, engine, guard, server, slo"),
    ],
)
def test_unknown_table(table: str, expected: str) -> None:
    assert errors_of(with_changes(**{table: {}})) == [expected]


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "scheduler_cls",
            "my.Scheduler",
            "[engine] scheduler_cls = 'my.Scheduler': reserved, the daemon installs its own scheduler "
            "subclass for the runtime batch cap; remove it",
        ),
        (
            "max_num_active_seqs",
            8,
            "[engine] max_num_active_seqs = 8: reserved, the batch cap is the daemon's to move; "
            "set [control] and max_num_seqs; remove it",
        ),
    ],
)
def test_reserved_engine_keys(key: str, value: Any, expected: str) -> None:
    assert errors_of(with_changes(engine={key: value})) == [expected]


def test_engine_argument_in_server_table() -> None:
    assert errors_of(with_changes(server={"max_model_len": 1024})) == [
        "[server] max_model_len: an engine argument; move it to [engine]"
    ]


@pytest.mark.parametrize("value", [0, -3, "64"])
def test_max_num_seqs_must_be_a_positive_int(value: Any) -> None:
    assert errors_of(with_changes(engine={"max_num_seqs": value})) == [
        f"[engine] max_num_seqs = {value!r}: must be an integer >= 1 (it caps the batch)"
    ]


def test_model_is_required() -> None:
    data = copy.deepcopy(BASE)
    del data["engine"]["model"]
    assert errors_of(data) == ["[engine] model is missing: set it to a model path or Hugging Face name"]


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("models/tiny", "{dir}/models/tiny"),  # a local path relative to the config file
        ("./my-model", "{dir}/my-model"),
        ("/abs/model", "/abs/model"),
        ("org/some-model", "org/some-model"),  # a Hugging Face name stays as it is
    ],
)
def test_model_path_resolution(tmp_path: Path, model: str, expected: str) -> None:
    data = with_changes(engine={"model": model})
    config = parse_config(data, tmp_path / "config.toml")
    assert config.engine["model"] == expected.format(dir=tmp_path.resolve())


def test_admin_port_must_differ_from_server_port() -> None:
    errors = errors_of(with_changes(admin={"port": 8000}))
    assert errors == ["[admin] port = 8000: same as [server] port; give the control plane its own port"]
    # on another address the same port does not collide
    config = parse_config(with_changes(admin={"port": 8000, "host": "127.0.0.2"}), DEFAULT)
    assert config.admin.port == config.server.port == 8000


def test_unknown_policy_lists_the_registered_names() -> None:
    errors = errors_of(with_changes(control={"policy": "nope"}))
    assert len(errors) == 1
    assert errors[0].startswith("[control] policy = 'nope': unknown policy 'nope': use one of ")
    assert REGISTRY  # filled by the lookup above
    for name in REGISTRY:
        assert name in errors[0]
    assert "'module:Class'" in errors[0]


@pytest.mark.parametrize(
    ("params", "fragments"),
    [
        ({"preset": "nope"}, ["[control] policy = 'static'", "preset = 'nope'", "interactive"]),
        (
            {"max_num_active_seqs": 0},
            ["[control] policy = 'static'", "max_num_active_seqs = 0: out of range; use a value >= 1"],
        ),
        ({"bogus": 1}, ["[control.params] for policy 'static'", "'bogus'"]),
    ],
)
def test_bad_policy_params_name_the_param(params: dict[str, Any], fragments: list[str]) -> None:
    errors = errors_of(with_changes(control={"policy": "static", "params": params}))
    assert len(errors) == 1
    for fragment in fragments:
        assert fragment in errors[0]


def test_policy_params_reach_the_config() -> None:
    config = parse_config(with_changes(control={"policy": "static", "params": {"preset": "small"}}), DEFAULT)
    assert config.control.params == {"preset": "small"}


def test_every_error_is_reported_at_once() -> None:
    data = with_changes(
        admission={"limt": 3, "max_queue": -1},
        server={"port": 0},
        control={"tick_s": "fast"},
        engine={"max_num_seq": 8, "scheduler_cls": "x"},
        contrl={},
    )
    errors = errors_of(data)
    assert len(errors) == 7, errors
    for fragment in (
        "unknown table [contrl]",
        "[admission] unknown key 'limt'",
        "[admission] max_queue = -1",
        "[server] port = 0",
        "[control] tick_s = 'fast'",
        "[engine] unknown key 'max_num_seq'",
        "[engine] scheduler_cls",
    ):
        assert sum(fragment in e for e in errors) == 1, fragment


@pytest.mark.parametrize(
    ("text", "expected_start"),
    [
        (None, "cannot read config file"),
        ("[admission\nlimit = 3\n", "{path}: not valid TOML"),
    ],
)
def test_unreadable_or_invalid_toml(tmp_path: Path, text: str | None, expected_start: str) -> None:
    path = tmp_path / "config.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert len(exc.value.errors) == 1
    assert exc.value.errors[0].startswith(expected_start.format(path=path))


# -- the CLI --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """`python -m controller check-config` on a bad and on the default file, run side by side
    (each process imports vLLM)."""
    text = DEFAULT.read_text()
    assert "\nlimit = 64\n" in text
    bad = tmp_path_factory.mktemp("cli") / "bad.toml"
    bad.write_text(text.replace("\nlimit = 64\n", "\nlimt = 64\n"))
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "controller", "check-config", "--config", str(path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, path in (("bad", bad), ("default", DEFAULT))
    }
    runs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        runs[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return runs


def test_cli_check_config_rejects_a_bad_file(cli_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = cli_runs["bad"]
    assert run.returncode == 1
    assert "invalid config (1 error(s))" in run.stderr
    assert "[admission] unknown key 'limt': did you mean 'limit'?" in run.stderr
    assert run.stdout == ""


def test_cli_check_config_accepts_the_default(cli_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    run = cli_runs["default"]
    assert run.returncode == 0, run.stderr
    effective = json.loads(run.stdout)
    assert effective["engine"]["max_num_seqs"] == 64
    assert {k: v for k, v in effective["admission"].items() if k != "classes"} == DEFAULT_ADMISSION
    assert [c["name"] for c in effective["admission"]["classes"]] == ["interactive", "batch"]
