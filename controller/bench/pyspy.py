"""Sampling a server's processes with py-spy, and where the samples went, per process role.

``record`` runs ``py-spy record --subprocesses --format raw`` on a server for a block of work and writes
py-spy's collapsed stacks: one line per distinct stack, ``frame;frame;...;frame COUNT``, the first frames
naming the process chain (``process PID:"cmdline"``), the others ``function (file:line)``. Idle threads are
not sampled (py-spy's default), so a count is CPU time at the sampling rate.

``summarize`` names each process by its role (the process a server started is the API server; the
EngineCore and the model worker are known by their main loops), and gives each role's CPU time and its
functions' inclusive time, in ms per request of the work sampled: comparable between two servers that
served the same requests.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RATE_HZ = 100
"""Samples a second per process: 10 ms resolution, and little enough CPU on a 2-core box."""
ROLES = (("engine-core", "run_engine_core"), ("worker", "worker_main"))
"""A process whose stacks hold this function is this role (vLLM's EngineCore and worker main loops)."""
API_SERVER = "api-server"
OTHER = "other"
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str | None:
    """The py-spy next to this Python (a venv install), else on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


@contextmanager
def record(pid: int, path: Path, rate_hz: int = RATE_HZ) -> Iterator[None]:
    """py-spy samples ``pid`` and its children during the block; the stacks go to ``path``."""
    spy = py_spy()
    if spy is None:
        raise FileNotFoundError("py-spy is not installed: pip install py-spy")
    path.parent.mkdir(parents=True, exist_ok=True)
    argv = [spy, "record", "--pid", str(pid), "--subprocesses", "--rate", str(rate_hz)]
    argv += ["--format", "raw", "--output", str(path), "--nonblocking"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # it attaches to each process before the work starts
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _split(line: str) -> tuple[list[str], list[str], int] | None:
    """(process frames, code frames, count) of one collapsed line."""
    stack, _, count = line.rstrip().rpartition(" ")
    if not stack or not count.isdigit():
        return None
    frames = stack.split(";")
    procs = [f for f in frames if f.startswith("process ")]
    return procs, frames[len(procs) :], int(count)


def _label(frame: str) -> str:
    """``function (file)``, the line number dropped: a function's samples at every line together."""
    m = _FRAME.match(frame)
    return f"{m['func']} ({m['file']})" if m else frame


def summarize(
    text: str, requests: int, rate_hz: int = RATE_HZ, top: int = 15, ours: str = "controller/"
) -> dict[str, Any]:
    """Per role: CPU ms per request; the ``top`` functions by inclusive ms per request (a function
    counted once per stack however often it recurs); and the ``top`` of those in files under ``ours``
    (the daemon's own code)."""
    lines = [s for s in (_split(line) for line in text.splitlines() if line.strip()) if s]
    root = min((len(p) for p, _, _ in lines), default=0)
    roles: dict[str, str] = {}
    for procs, frames, _ in lines:  # a process's role: a main loop seen in any of its stacks
        names = {_label(f).split(" (", 1)[0].rsplit(".", 1)[-1] for f in frames}  # methods too
        for role, func in ROLES:
            if func in names:
                roles[procs[-1] if procs else ""] = role
    total: Counter[str] = Counter()
    funcs: dict[str, Counter[str]] = defaultdict(Counter)
    for procs, frames, count in lines:
        pid = procs[-1] if procs else ""
        role = roles.get(pid) or (API_SERVER if len(procs) == root else OTHER)
        total[role] += count
        for label in {_label(f) for f in frames}:
            funcs[role][label] += count
    scale = 1000.0 / rate_hz / max(requests, 1)

    def ranked(counts: Counter[str], keep: Any) -> list[list[Any]]:
        chosen = [(label, c) for label, c in counts.most_common() if keep(label)][:top]
        return [[label, round(c * scale, 3)] for label, c in chosen]

    return {
        "requests": requests,
        "rate_hz": rate_hz,
        "roles": {
            role: {
                "cpu_ms_per_request": round(n * scale, 3),
                "top": ranked(funcs[role], lambda _: True),
                "ours": ranked(funcs[role], lambda label: f"({ours}" in label),
            }
            for role, n in total.most_common()
        },
    }
