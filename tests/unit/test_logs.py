"""Logging: structlog events and stdlib records (vLLM's included) come out as one JSON line each, in
the daemon and, through the dictConfig handed to vLLM, in the processes vLLM spawns."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from controller.lifecycle.logs import HANDLER_NAME, PINNED_LOGGERS, QUIET_LOGGERS, configure_logging

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def isolated_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """configure_logging changes process-wide state: put it all back."""
    for var in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.setenv(var, "")  # records the original value for the teardown
        monkeypatch.delenv(var)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in (*QUIET_LOGGERS, *PINNED_LOGGERS)}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lvl in levels.items():
        logging.getLogger(name).setLevel(lvl)
    structlog.reset_defaults()


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def test_structlog_and_stdlib_records_are_one_json_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    structlog.get_logger("controller.test").info("knob_changed", knob="batch_cap", value=32)
    logging.getLogger("vllm.test").info("KV cache size: %d tokens\nsecond line", 4096)
    lines = json_lines(capsys.readouterr().out)
    assert len(lines) == 2
    ours, vllms = lines
    assert ours["event"] == "knob_changed"
    assert (ours["knob"], ours["value"]) == ("batch_cap", 32)
    assert vllms["event"] == "KV cache size: 4096 tokens\nsecond line"
    for line, logger in ((ours, "controller.test"), (vllms, "vllm.test")):
        assert line["level"] == "info"
        assert line["logger"] == logger
        assert line["timestamp"].endswith("Z")
        assert "process" not in line  # only records of other processes are labelled


def test_other_libraries_share_the_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    for name in ("uvicorn.error", "aiohttp.access", "apscheduler.scheduler"):
        logging.getLogger(name).warning("from %s", name)
    lines = json_lines(capsys.readouterr().out)
    assert [(x["logger"], x["level"]) for x in lines] == [
        ("uvicorn.error", "warning"),
        ("aiohttp.access", "warning"),
        ("apscheduler.scheduler", "warning"),
    ]


def test_auto_mode_writes_json_when_stdout_is_not_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging()
    structlog.get_logger("t").info("serving", port=8000)
    assert json_lines(capsys.readouterr().out)[0]["port"] == 8000


def test_console_mode(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=False)
    structlog.get_logger("t").info("serving", port=8000)
    logging.getLogger("vllm.test").info("vllm line")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert "serving" in out[0] and "port=8000" in out[0]
    assert "vllm line" in out[1]
    with pytest.raises(json.JSONDecodeError):
        json.loads(out[0])


def test_levels(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("warning", json_logs=True)
    structlog.get_logger("t").info("hidden")
    logging.getLogger("vllm.test").info("hidden too")
    structlog.get_logger("t").warning("shown")
    configure_logging("INFO", json_logs=True)
    logging.getLogger("apscheduler.executors.default").info('Running job "control_tick"')  # every tick
    assert [x["event"] for x in json_lines(capsys.readouterr().out)] == ["shown"]


def test_our_events_survive_a_library_raising_the_root_level(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's build_app imports model_hosting_container_standards, which sets the root to ERROR."""
    configure_logging(json_logs=True)
    logging.getLogger().setLevel(logging.ERROR)
    structlog.get_logger("controller.lifecycle.daemon").info("serving")
    structlog.get_logger("policies.hysteresis").info("cut")
    logging.getLogger("torch").warning("third-party noise follows the root")
    assert [x["event"] for x in json_lines(capsys.readouterr().out)] == ["serving", "cut"]


def test_reconfiguring_keeps_one_handler(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    configure_logging(json_logs=True)
    assert [h.get_name() for h in logging.getLogger().handlers].count(HANDLER_NAME) == 1
    logging.getLogger("vllm.test").info("once")
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_exceptions_stay_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_logs=True)
    try:
        raise ValueError("bad")
    except ValueError:
        structlog.get_logger("t").exception("engine_failed")
        logging.getLogger("vllm.test").exception("vllm failed")
    lines = json_lines(capsys.readouterr().out)
    assert len(lines) == 2
    assert all("ValueError: bad" in x["exception"] for x in lines)


def test_vllm_gets_a_dictconfig_for_its_processes() -> None:
    configure_logging("DEBUG", json_logs=True)
    path = Path(os.environ["VLLM_LOGGING_CONFIG_PATH"])
    config = json.loads(path.read_text())
    assert config["root"] == {"level": "DEBUG", "handlers": [HANDLER_NAME]}
    assert config["loggers"]["vllm"]["propagate"] is True
    assert config["formatters"][HANDLER_NAME]["json_logs"] is True
    configure_logging("INFO", json_logs=False)  # rewritten in place
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(path)
    assert json.loads(path.read_text())["root"]["level"] == "INFO"


def _child(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter with the daemon's environment: what vLLM's EngineCore process is."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ),
        check=True,
    )


def test_a_spawned_process_applying_the_config_logs_json_lines() -> None:
    """vLLM applies the file with logging.config.dictConfig in every process it starts."""
    configure_logging(json_logs=True)
    code = (
        "import json, logging, logging.config, multiprocessing, os\n"
        "multiprocessing.current_process().name = 'EngineCore'\n"
        "logging.config.dictConfig(json.load(open(os.environ['VLLM_LOGGING_CONFIG_PATH'])))\n"
        "logging.getLogger('vllm.v1.engine.core').info('child says %s', 'hi')\n"
        "logging.getLogger('torch').debug('below the level')\n"
    )
    (line,) = json_lines(_child(code, 30).stdout)
    assert line["event"] == "child says hi"
    assert line["logger"] == "vllm.v1.engine.core"
    assert line["process"] == "EngineCore"
    assert isinstance(line["pid"], int)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllms_own_logging_setup_uses_our_config() -> None:
    """What EngineCore.run_engine_core does: vllm.logger.configure_logging(LoggingConfig())."""
    configure_logging(json_logs=True)
    code = (
        "import logging\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging, init_logger, set_vllm_process_name\n"
        "set_vllm_process_name('EngineCore_DP0')\n"
        "configure_logging(LoggingConfig())\n"
        "init_logger('vllm.v1.engine.core').info('engine core ready')\n"
    )
    out = _child(code, 120).stdout
    lines = json_lines(out)  # every line is JSON: vLLM's text handler is gone
    mine = [x for x in lines if x["event"] == "engine core ready"]
    assert len(mine) == 1
    assert mine[0]["process"] == "EngineCore_DP0"
    assert mine[0]["level"] == "info"
