"""``vllm-autopilot serve [MODEL] [vllm serve options]``: vLLM's own parser, laid over the TOML file.

Command line > vLLM YAML --config > our TOML file > defaults; names, help and errors are vLLM's; every
value passes the file's validation. The first test pays for importing vLLM (seconds, once).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from controller.config.cli_layer import NO_FILE, load_layered, serve_config, split_toml
from controller.config.load import ConfigError, describe, load_config, parse_config
from controller.engine.runtime import serve_args

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "config.toml"


def argv(line: str) -> list[str]:
    return line.split()


# -- the README's three `vllm serve` lines, one to one ---------------------------------------------------


def test_readme_example_batch_cap_and_port() -> None:
    config = serve_config(argv("meta-llama/Llama-3.1-8B-Instruct --max-num-seqs 128 --port 8000"))
    assert config.engine == {"model": "meta-llama/Llama-3.1-8B-Instruct", "max_num_seqs": 128}
    assert config.max_num_seqs == 128
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.path == NO_FILE
    assert (config.admin.host, config.admin.port) == ("127.0.0.1", 9400)  # our documented defaults


def test_readme_example_tensor_parallel() -> None:
    line = "Qwen/Qwen2.5-7B-Instruct --tensor-parallel-size 2 --gpu-memory-utilization 0.9"
    config = serve_config(argv(line))
    assert config.engine == {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.9,
        "max_num_seqs": 256,  # vLLM's default, which the batch cap starts from
    }


def test_readme_example_api_key_and_served_model_name() -> None:
    line = "Qwen/Qwen2.5-1.5B-Instruct --api-key sk-local --served-model-name qwen --port 8001"
    config = serve_config(argv(line))
    assert config.engine["served_model_name"] == ["qwen"]  # a list, as vLLM's parser makes it
    assert config.server.vllm == {"api_key": ["sk-local"]}
    assert config.server.port == 8001
    assert describe(config)["server"]["vllm"]["api_key"] != ["sk-local"]  # redacted where shown


def test_the_file_takes_the_same_values() -> None:
    """What the command line sets is what the same keys in the file set."""
    line = "Qwen/Qwen2.5-1.5B-Instruct --api-key sk-local --served-model-name qwen --max-num-seqs 8"
    from_file = parse_config(
        {
            "engine": {"model": "Qwen/Qwen2.5-1.5B-Instruct", "served_model_name": "qwen", "max_num_seqs": 8},
            "server": {"api_key": "sk-local"},
        },
        NO_FILE,
    )
    from_cli = serve_config(argv(line))
    assert from_cli.engine == {**from_file.engine, "served_model_name": ["qwen"]}
    assert from_cli.server.vllm == {"api_key": ["sk-local"]}


def test_our_own_flags_set_our_tables() -> None:
    line = "m --admin-port 9500 --admin-host 127.0.0.2 --policy slo --slo-ttft 1.5 --slo-tpot 0.05"
    config = serve_config(argv(line))
    assert (config.admin.host, config.admin.port, config.control.policy) == ("127.0.0.2", 9500, "slo")
    assert config.slo is not None
    assert describe(config)["slo"]["ttft_s"] == 1.5
    assert describe(config)["slo"]["tpot_s"] == 0.05


def test_without_a_model_vllms_default_serves() -> None:
    assert serve_config([]).engine["model"] == serve_args.default_model() == "Qwen/Qwen3-0.6B"


def test_a_local_model_is_relative_to_the_working_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert serve_config(["models/tiny"]).engine["model"] == str(ROOT / "models" / "tiny")


def test_a_local_model_keeps_the_served_name_vllm_serve_gives_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`vllm serve models/tiny` answers to "models/tiny": resolving the path must not rename the model
    (a client of the same command would get 404), unless a served name is set by flag or file."""
    monkeypatch.chdir(ROOT)
    assert serve_config(["models/tiny"]).engine["served_model_name"] == ["models/tiny"]
    named = serve_config(["models/tiny", "--served-model-name", "t"])
    assert named.engine["served_model_name"] == ["t"]
    file = write(tmp_path / "c.toml", '[engine]\nmodel = "x"\nserved_model_name = ["from-file"]\n')
    assert serve_config(["--config", str(file), "models/tiny"]).engine["served_model_name"] == ["from-file"]
    assert "served_model_name" not in serve_config(["Qwen/Qwen3-0.6B"]).engine  # a hub name stays as written


def test_options_vllm_parses_into_objects_keep_their_strings() -> None:
    """--compilation-config becomes a vLLM object; the table keeps the JSON, which vLLM parses again."""
    config = serve_config(["m", "-cc", '{"mode": 0}', "--max-model-len", "2k", "--enforce-eager"])
    assert config.engine["compilation_config"] == '{"mode": 0}'
    assert config.engine["max_model_len"] == 2000  # vLLM's size suffix, parsed by vLLM
    assert config.engine["enforce_eager"] is True


# -- precedence ---------------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


TOML = """
    [engine]
    model = "org/m"
    max_num_seqs = 16
    max_model_len = 1024
    [server]
    port = 9000
    [admission]
    limit = 12
"""


def test_command_line_beats_file_beats_defaults(tmp_path: Path) -> None:
    toml = write(tmp_path / "c.toml", TOML)
    # --port 8000 is vLLM's default value, given on the command line: it still beats the file
    config = serve_config(["--config", str(toml), "--port", "8000", "--max-num-seqs", "32"])
    assert config.server.port == 8000
    assert config.max_num_seqs == 32
    assert config.engine["max_model_len"] == 1024  # the file's, the command line left it out
    assert config.admission.limit == 12  # the file's
    assert config.admission.max_queue == 1024  # the default
    assert config.path == toml


def test_the_model_argument_beats_the_files(tmp_path: Path) -> None:
    toml = write(tmp_path / "c.toml", TOML)
    assert serve_config(["other/model", "--config", str(toml)]).engine["model"] == "other/model"
    assert serve_config([f"--config={toml}"]).engine["model"] == "org/m"


def test_a_yaml_config_is_vllms_and_sits_between(tmp_path: Path) -> None:
    toml = write(tmp_path / "c.toml", TOML)
    yaml = write(tmp_path / "v.yaml", "max-num-seqs: 64\nmax-model-len: 512\n")
    config = serve_config(["--config", str(toml), "--config", str(yaml), "--max-model-len", "256"])
    assert config.max_num_seqs == 64  # YAML over TOML
    assert config.engine["max_model_len"] == 256  # command line over YAML
    assert config.server.port == 9000  # TOML over defaults


def test_a_reload_keeps_the_command_line_on_top(tmp_path: Path) -> None:
    toml = write(tmp_path / "c.toml", TOML)
    config = serve_config(["--config", str(toml), "--port", "8000"])
    write(toml, TOML.replace("limit = 12", "limit = 20").replace("port = 9000", "port = 9001"))
    again = load_layered(config.path, config.overlay)  # what Reloader does
    assert (again.admission.limit, again.server.port) == (20, 8000)


def test_serve_config_file_alone_is_the_file(tmp_path: Path) -> None:
    """The systemd unit's and deploy/k8s/'s `serve --config FILE.toml` reads exactly the file."""
    assert describe(serve_config(["--config", str(DEFAULT)])) == describe(load_config(DEFAULT))
    assert split_toml(["--config", "/etc/vllm-autopilot/config.toml"]) == (
        Path("/etc/vllm-autopilot/config.toml"),
        [],
    )


# -- errors ---------------------------------------------------------------------------------------


def exit_of(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[Any, str, str]:
    with pytest.raises(SystemExit) as exc:
        serve_config(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_an_unknown_option_gets_vllms_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = exit_of(["m", "--max-num-sequences", "8"], capsys)
    assert code == 2
    assert "usage: vllm-autopilot serve [model_tag] [options]" in err
    assert "unrecognized arguments: --max-num-sequences" in err


def test_a_value_vllms_parser_refuses_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = exit_of(["m", "--max-num-seqs", "many"], capsys)
    assert code == 2
    assert "argument --max-num-seqs: invalid int value: 'many'" in err


def test_an_unsupported_serve_option_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = exit_of(["m", "--headless"], capsys)
    assert code == 2
    assert "argument --headless: not supported here" in err


def test_a_bad_value_gets_the_files_error_and_its_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as from_file:
        parse_config({"engine": {"model": "m", "gpu_memory_utilization": 1.5}}, NO_FILE)
    with pytest.raises(ConfigError) as from_cli:
        serve_config(["m", "--gpu-memory-utilization", "1.5"])
    assert from_cli.value.errors == [f"{from_file.value.errors[0]} (from --gpu-memory-utilization)"]
    with pytest.raises(ConfigError) as ours:
        serve_config(["m", "--admin-port", "8000"])
    assert ours.value.errors == [
        "[admin] port = 8000: same as [server] port; give the control plane its own port (from --admin-port)"
    ]


def test_one_toml_file_at_most() -> None:
    with pytest.raises(ConfigError, match=r"more than one --config FILE\.toml"):
        split_toml(["--config", "a.toml", "--config", "b.TOML"])


# -- help ---------------------------------------------------------------------------------------------


def test_help_lists_vllms_groups_and_ours(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM keeps --help=KEYWORD on its parser class; start from none and leave none behind
    monkeypatch.setattr(FlexibleArgumentParser, "_search_keyword", None)
    code, out, _ = exit_of(["--help"], capsys)
    assert code == 0
    assert "usage: vllm-autopilot serve [model_tag] [options]" in out
    for group in ("ModelConfig", "SchedulerConfig", "Frontend", "autopilot"):
        assert group in out
    code, out, _ = exit_of(["--help=autopilot"], capsys)
    assert code == 0
    for flag in ("--admin-port", "--admin-host", "--policy", "--slo-ttft", "--slo-tpot"):
        assert flag in out
    assert "--max-num-seqs" not in out
