"""The faults of ``bench chaos``, injected into a running daemon while the load runs.

Each fault acts, then checks what the daemon must do about it, and records both (:class:`FaultRecord`):

- ``kill_engine``: SIGKILL the EngineCore, then (while it rebuilds) SIGHUP a valid config; the daemon
  must start a new engine (``autopilot_engine_generation`` rises, ``/healthz`` 200 again) and take the
  reload (``autopilot_config_reloads_total{result="ok"}`` rises).
- ``reload_valid``: a config with one live value changed; the reload is taken and ``/state`` shows it.
- ``reload_broken_toml``, ``reload_not_utf8``, ``reload_bad_engine`` (``gpu_memory_utilization = 1.5``):
  the reload is refused (``result="error"``), the old config stays, the engine is not restarted.
- ``reload_nan``: ``[guard] stall_timeout_s = nan`` (TOML allows it, and a range check lets it
  through): refused the same way; taken, it would have the guard rebuild a healthy engine at every check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from controller.bench.servers import Launched, to_toml

FAULTS = (
    "reload_valid",
    "reload_broken_toml",
    "reload_bad_engine",
    "reload_not_utf8",
    "reload_nan",
    "kill_engine",
)
"""In this order, so that even a short soak tries every reload before the long engine rebuild."""
RELOAD_WAIT_S = 20.0
"""How long a reload may take to be counted (the daemon acts on SIGHUP at its next run-loop turn)."""


@dataclass(frozen=True)
class FaultRecord:
    """One injected fault: what was expected of the daemon and what it did."""

    at_s: float
    fault: str
    expected: str
    observed: str
    ok: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return None, b""


def metric(metrics_url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample of the daemon's /metrics (summed over label sets matching ``labels``)."""
    status, body = http_get(metrics_url)
    if status != 200:
        return None
    total: float | None = None
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total = (total or 0.0) + float(s.value)
    return total


def _is_engine_core(proc: psutil.Process) -> bool:
    return "EngineCore" in proc.name() or "EngineCore" in " ".join(proc.cmdline())


def engine_core_alive(pid: int) -> bool:
    """Whether ``pid`` is still an EngineCore process (not a zombie, not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and _is_engine_core(proc)
    except psutil.Error:
        return False


def engine_cores(pid: int) -> list[psutil.Process]:
    """The EngineCore processes under the daemon ``pid``."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if _is_engine_core(child):
                found.append(child)
    return found


@dataclass
class Injector:
    """Injects the faults into one launched daemon, in turn; remembers every EngineCore it saw."""

    server: Launched
    recovery_timeout_s: float
    t0: float = field(default_factory=time.monotonic)
    records: list[FaultRecord] = field(default_factory=list)
    engine_pids: set[int] = field(default_factory=set)
    _good: dict[str, Any] = field(default_factory=dict)
    _variant: int = 0

    def __post_init__(self) -> None:
        assert self.server.config_path is not None, "faults are injected into our daemon"
        self._path: Path = self.server.config_path
        self._good = tomllib.loads(self._path.read_text())
        self._admin = str(self.server.state_url).rsplit("/", 1)[0]

    def watch_engines(self) -> None:
        self.engine_pids.update(p.pid for p in engine_cores(self.server.pid))

    async def inject(self, fault: str) -> FaultRecord:
        acts: dict[str, Callable[[], Awaitable[tuple[str, str, bool]]]] = {
            "kill_engine": self._kill_engine,
            "reload_valid": self._reload_valid,
            "reload_broken_toml": lambda: self._reload_refused(b"[engine\nmodel = ", "broken TOML"),
            "reload_not_utf8": lambda: self._reload_refused(b"\xff\xfe[engine]\n", "not UTF-8"),
            "reload_bad_engine": self._reload_bad_engine,
            "reload_nan": self._reload_nan,
        }
        at = time.monotonic() - self.t0
        expected, observed, ok = await acts[fault]()
        record = FaultRecord(round(at, 1), fault, expected, observed, ok)
        self.records.append(record)
        print(f"chaos {at:7.1f}s {fault}: {'ok' if ok else 'FAILED'} ({observed})", flush=True)
        return record

    # -- reading the daemon -----------------------------------------------------------------------

    def _reloads(self, result: str) -> float:
        return metric(self.server.metrics_url, "autopilot_config_reloads_total", {"result": result}) or 0.0

    def _generation(self) -> float | None:
        return metric(self.server.metrics_url, "autopilot_engine_generation")

    def _state(self) -> dict[str, Any]:
        status, body = http_get(f"{self._admin}/state")
        return json.loads(body) if status == 200 else {}

    async def _wait(self, check: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await asyncio.to_thread(check):
                return True
            await asyncio.sleep(0.5)
        return False

    def _hup(self, content: bytes | dict[str, Any]) -> None:
        self._path.write_bytes(content if isinstance(content, bytes) else to_toml(content).encode())
        if self.server.proc is not None:
            self.server.proc.send_signal(signal.SIGHUP)

    def _next_variant(self) -> dict[str, Any]:
        """The good config with ``[admission] aging_s`` moved: live, harmless, visible in /state."""
        self._variant += 1
        admission = dict(self._good.get("admission") or {})
        admission["aging_s"] = 10.0 + self._variant % 2
        self._good = {**self._good, "admission": admission}
        return self._good

    # -- the faults -------------------------------------------------------------------------------

    async def _kill_engine(self) -> tuple[str, str, bool]:
        expected = "a new engine serves and a SIGHUP sent during the rebuild is taken"
        cores = engine_cores(self.server.pid)
        if not cores:
            return expected, "no EngineCore to kill (a rebuild still running?)", False
        generation, reloads = self._generation() or 0.0, self._reloads("ok")
        for core in cores:
            self.engine_pids.add(core.pid)
            with contextlib.suppress(psutil.Error):
                core.kill()
        await asyncio.sleep(2.0)
        self._hup(self._next_variant())

        def recovered() -> bool:
            gen = self._generation()
            return gen is not None and gen > generation and http_get(f"{self._admin}/healthz")[0] == 200

        start = time.monotonic()
        up = await self._wait(recovered, self.recovery_timeout_s)
        took = time.monotonic() - start
        taken = await self._wait(lambda: self._reloads("ok") > reloads, RELOAD_WAIT_S)
        self.watch_engines()
        observed = (
            f"engine {'back' if up else 'NOT back'} after {took:.0f} s; "
            f"reload during the rebuild {'taken' if taken else 'NOT taken'}"
        )
        return expected, observed, up and taken

    async def _reload_valid(self) -> tuple[str, str, bool]:
        before = self._reloads("ok")
        config = self._next_variant()
        want = config["admission"]["aging_s"]
        self._hup(config)

        def shown() -> bool:
            admission = (self._state().get("config") or {}).get("admission") or {}
            return bool(self._reloads("ok") > before and admission.get("aging_s") == want)

        ok = await self._wait(shown, RELOAD_WAIT_S)
        return "taken: /state shows the new aging_s", f"aging_s={want} {'shown' if ok else 'NOT shown'}", ok

    async def _reload_refused(self, content: bytes, what: str) -> tuple[str, str, bool]:
        before, generation = self._reloads("error"), self._generation()
        config_before = self._state().get("config")
        self._hup(content)
        refused = await self._wait(lambda: self._reloads("error") > before, RELOAD_WAIT_S)
        self._path.write_text(to_toml(self._good))  # the operator fixes the file
        same_engine = self._generation() == generation
        serving = http_get(f"{self._admin}/healthz")[0] == 200
        kept = bool(config_before) and self._state().get("config") == config_before  # every key, as shown
        observed = ", ".join(
            (
                "refused" if refused else "NOT refused",
                "old config kept" if kept else "old config NOT kept",
                "engine kept" if same_engine else "engine restarted",
                "serving" if serving else "NOT serving",
            )
        )
        ok = refused and kept and same_engine and serving
        return f"{what}: refused, old config kept, engine kept", observed, ok

    async def _reload_bad_engine(self) -> tuple[str, str, bool]:
        bad = {**self._good, "engine": {**self._good["engine"], "gpu_memory_utilization": 1.5}}
        return await self._reload_refused(to_toml(bad).encode(), "gpu_memory_utilization = 1.5")

    async def _reload_nan(self) -> tuple[str, str, bool]:
        bad = {**self._good, "guard": {**(self._good.get("guard") or {}), "stall_timeout_s": float("nan")}}
        return await self._reload_refused(to_toml(bad).encode(), "[guard] stall_timeout_s = nan")


async def inject_faults(injector: Injector, duration_s: float, every_s: float) -> None:
    """The faults in turn, one every ``every_s`` seconds, until ``duration_s`` has passed (it returns
    as soon as the next fault would fall after it, so the soak never waits for one that is not sent)."""
    i = 0
    while time.monotonic() - injector.t0 + every_s <= duration_s:
        await asyncio.sleep(every_s)
        await injector.inject(FAULTS[i % len(FAULTS)])
        i += 1
