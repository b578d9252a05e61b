"""Four walks through the house, counted by tracing what runs: the files each walk enters and the
file-to-file calls it makes (distinct caller -> callee pairs between the project's own files).

    python tools/walks.py            # from the repository root; about a minute

- **a request**: one request through the daemon's governed engine client and the admission gate
  (``GovernedEngineClient.generate`` and its stream), in a short twin run (the twin passes each
  request through the daemon's own client; the HTTP middleware is not on this walk);
- **a tick**: ``ControlLoop.tick``, in the same run;
- **a config value on reload**: ``Reloader._reload``, in the unit test that reloads a file which
  changes every live table;
- **a `simulate` run**: ``run_simulate``, the whole short twin run.

A call counts for a walk when the walk's entry is on its stack (an awaited coroutine's caller is on
its stack; a task it spawns is not). Only files under ``controller/`` and ``policies/`` count. The
counts measure the code that ran, so they hold the house's shape and not the load's: a longer run
adds no file or pair. Used to compare two trees (run it in each); it asserts nothing."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path.cwd()
OWN = (str(ROOT / "controller") + "/", str(ROOT / "policies") + "/")

ENTRIES: dict[str, set[tuple[str, str]]] = {
    "a request": {
        ("controller/engine/frontend/client.py", "GovernedEngineClient.generate"),
        ("controller/engine/frontend/client.py", "GovernedEngineClient._generate"),
    },
    "a tick": {("controller/control/loop.py", "ControlLoop.tick")},
    "a config value on reload": {("controller/lifecycle/reload.py", "Reloader._reload")},
    "a simulate run": {("controller/sim/cli.py", "run_simulate")},
}
SIMULATE = [
    "simulate", "--workload", "shared-prefix", "--rate", "6", "--output-tokens", "48",
    "--system-prompts", "4", "--system-tokens", "480", "--turns", "1", "--user-tokens", "48",
    "--duration", "8", "--profile", "cpu-smollm2-avx512", "--slo-ttft", "2", "--slo-tpot", "0.08",
    "--policy", "slo", "--seed", "0", "--no-report",
]  # fmt: skip
TWIN = ("controller/sim/", "controller/load/")
"""What stands in for vLLM and the client in the twin run: not the daemon's, left out of the
request's and the tick's walks."""
RELOAD_TEST = "tests/unit/test_reload_safety.py::test_a_reload_that_builds_swaps_every_live_table_in"


class Walks:
    """Per walk, the project files entered and the caller -> callee file pairs."""

    def __init__(self) -> None:
        self.files: dict[str, set[str]] = {w: set() for w in ENTRIES}
        self.pairs: dict[str, set[tuple[str, str]]] = {w: set() for w in ENTRIES}
        self._entry = {e: w for w, es in ENTRIES.items() for e in es}

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(OWN):
            return
        callee = _rel(frame)
        caller = None
        walks = set()
        f: FrameType | None = frame
        while f is not None:
            if f.f_code.co_filename.startswith(OWN):
                rel = _rel(f)
                if caller is None and f is not frame:
                    caller = rel
                walk = self._entry.get((rel, f.f_code.co_qualname))
                if walk is not None:
                    walks.add(walk)
            f = f.f_back
        for walk in walks:
            daemon_only = walk in ("a request", "a tick")
            if daemon_only and callee.startswith(TWIN):
                continue
            self.files[walk].add(callee)
            if caller is not None and caller != callee and not (daemon_only and caller.startswith(TWIN)):
                self.pairs[walk].add((caller, callee))

    def run(self, body: Callable[[], object]) -> None:
        sys.setprofile(self.profile)
        try:
            body()
        finally:
            sys.setprofile(None)


def _rel(frame: FrameType) -> str:
    return str(Path(frame.f_code.co_filename).relative_to(ROOT))


def main() -> int:
    import pytest

    from controller.cli import main as cli

    walks = Walks()
    with tempfile.TemporaryDirectory() as out:
        walks.run(lambda: cli([*SIMULATE, "--out", out]))
    walks.run(lambda: pytest.main(["-q", "-p", "no:cacheprovider", RELOAD_TEST]))
    print("| walk | files | file-to-file calls |")
    print("| --- | ---: | ---: |")
    for walk in ENTRIES:
        print(f"| {walk} | {len(walks.files[walk])} | {len(walks.pairs[walk])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
