"""``vllm-autopilot gpu-check`` on this CPU, on the tiny model: the checks that apply pass (the engine
spawned, a restart of the live engine the daemon survives, a clean stop), the GPU ones are skipped
with the reason, and the table and the JSON say so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, write_config

pytestmark = pytest.mark.slow


def test_gpu_check_on_a_cpu_passes_what_applies_and_skips_the_rest(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.toml")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "controller", "gpu-check", "--config", str(config), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = json.loads((out / "gpu-check.json").read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert done.returncode == 0, done.stdout + done.stderr
    assert statuses == {
        "engine_path": "pass",
        "daemon_cuda_context": "skip",
        "restart_survived": "pass",
        "clean_stop": "pass",
        "memory_restart_co_tenant": "skip",
        "guard_at_util_0_97": "skip",
        "parity_with_vllm_serve": "skip",
        "tp2_dp2_restarts": "skip",
    }
