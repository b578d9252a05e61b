"""vLLM's router (``vllm-router``, the ``fleet`` extra's wheel) in front of servers the bench started:
found beside this interpreter or on PATH, started in its own process group on a free port with the
recipe's breaker (docs/fleet.md), yielded once it answers ``/readiness``, always stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from controller.bench.servers import HOST, free_port, http_status, log_tail


def router_binary() -> Path:
    """``vllm-router`` from this interpreter's environment or from PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    on_path = shutil.which("vllm-router")
    if on_path is None:
        raise FileNotFoundError("vllm-router: not installed (pip install 'vllm-autopilot[fleet]')")
    return Path(on_path)


def router_argv(
    binary: Path,
    port: int,
    workers: Sequence[str],
    policy: str,
    metrics_port: int,
    breaker_open_s: int = 10,
    request_timeout_s: int = 600,
) -> list[str]:
    """The router on loopback before a fixed worker list, with the recipe's breaker (3 503s in a row
    open it for ``breaker_open_s``)."""
    argv = [str(binary), "--host", HOST, "--port", str(port), "--policy", policy]
    argv += ["--worker-urls", *workers, "--prometheus-port", str(metrics_port)]
    argv += ["--worker-startup-check-interval", "1"]  # also power_of_two's /get_load poll period
    argv += ["--cb-failure-threshold", "3", "--cb-timeout-duration-secs", str(breaker_open_s)]
    return [*argv, "--request-timeout-secs", str(request_timeout_s)]


@contextmanager
def routed(
    workers: Sequence[str],
    log: Path,
    policy: str = "round_robin",
    startup_timeout_s: float = 60.0,
    binary: Path | None = None,
    breaker_open_s: int = 10,
    request_timeout_s: int = 600,
) -> Iterator[str]:
    """``vllm-router`` (``binary``, else ``router_binary()``) in front of ``workers`` (data-plane
    URLs); yields its URL once it is ready (200 on ``/readiness``: a worker is healthy)."""
    port = free_port()
    exe = router_binary() if binary is None else binary
    argv = router_argv(exe, port, workers, policy, free_port(), breaker_open_s, request_timeout_s)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while http_status(base + "/readiness") != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited ({proc.returncode}):\n{log_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router not ready after {startup_timeout_s:.0f} s:\n{log_tail(log)}")
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
