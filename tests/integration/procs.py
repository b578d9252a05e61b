"""The daemon as a subprocess (`python -m controller serve`), for tests that need real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import ROOT


def wait_healthy(popen: subprocess.Popen[bytes], admin_url: str, timeout_s: float = 240.0) -> None:
    """Until ``/healthz`` answers 200; fails if the daemon exits or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert popen.poll() is None, "daemon exited during startup"
        try:
            with urllib.request.urlopen(admin_url + "/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("daemon did not become healthy")


@contextmanager
def daemon_process(config: Path, admin_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """Start the daemon on ``config`` in its own process group (log beside the config), yield it once
    healthy, and kill the group if it is still running at the end."""
    with open(config.parent / "daemon.log", "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "controller", "serve", "--config", str(config)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_healthy(popen, admin_url)
            yield popen
        finally:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
