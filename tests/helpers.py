"""The tests' one helpers module: paths and ports, the config writer, the daemon (in-process and as a
subprocess), the streaming client, and the gate and observation builders.

A fake or builder two test modules share belongs here (the twin's scenarios are ``tests/sim/scenarios.py``),
not in one test module that another imports; ``tests/conftest.py`` holds only the model fixtures, and the
integration tests start one real engine per module. The daemon and vLLM are imported inside the functions
that need them: unit tests import this module without paying for vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import aiohttp
import psutil

from controller.admission.queues import GateStats
from controller.admission.ttft import TtftCheck
from controller.bench.servers import serving, to_toml
from controller.load.client import pooled_connector, post
from policies.base import Observation, Policy
from policies.slo_targets import SloTargets

if TYPE_CHECKING:
    from controller.lifecycle.daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "tiny"
SMOLLM2_MODEL = ROOT / "models" / "smollm2"


def shipped_config() -> dict[str, Any]:
    """The project's default ``config.toml`` as plain tables (the real-model tests serve its engine)."""
    return tomllib.loads((ROOT / "config.toml").read_text())


# -- ports and config files -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(path: Path, **tables: dict[str, Any]) -> Path:
    """A config for the tiny CPU model; ``tables`` override keys per table."""
    base: dict[str, dict[str, Any]] = {
        "engine": {
            "model": str(TINY_MODEL),
            "max_num_seqs": 16,
            "max_model_len": 2048,
            "kv_cache_memory_bytes": 64 << 20,
            "scheduling_policy": "priority",
            "enable_prefix_caching": False,
            "served_model_name": ["tiny"],
        },
        "server": {"host": "127.0.0.1", "port": free_port(), "shutdown_timeout_s": 20.0},
        "admin": {"host": "127.0.0.1", "port": free_port()},
        "admission": {"limit": 16, "max_queue": 256},
        "control": {"tick_s": 1.0, "policy": "static", "warmup_s": 0.0},
    }
    for name, values in tables.items():
        base.setdefault(name, {}).update(values)
    path.write_text(to_toml(base))
    return path


# -- the daemon ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_daemon(config: Path, **parts: Any) -> AsyncIterator[Daemon]:
    """The daemon in this process on ``config`` (no signal handlers), started and shut down around the
    block; ``parts`` go to ``Daemon`` (fake host or GPU sources)."""
    from controller.config.load import load_config
    from controller.lifecycle.daemon import Daemon

    d = Daemon(load_config(config), install_signals=False, **parts)
    try:
        await d.startup()
        yield d
    finally:
        await d.shutdown()


@contextlib.contextmanager
def daemon_process(
    config: Path, admin_url: str, startup_timeout_s: float = 240.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Start the daemon on ``config`` in its own process group (log beside the config), yield it once
    healthy (SmolLM2's first build compiles for up to ~4 min on the 2-core box: give it more), and
    kill the group if it is still running at the end."""
    command = [sys.executable, "-m", "controller", "serve", "--config", str(config)]
    with serve_process(command, config.parent / "daemon.log", admin_url, startup_timeout_s) as popen:
        yield popen


@contextlib.contextmanager
def serve_process(
    command: list[str], log_path: Path, admin_url: str, startup_timeout_s: float = 240.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (a daemon's serve line) as the bench runs a server (``bench/servers.serving``),
    from the repository's root; yield it once ``/healthz`` answers, and kill its group at the end."""
    with serving(command, log_path, [admin_url + "/healthz"], startup_timeout_s, 0.0, ROOT) as popen:
        yield popen


def url(d: Daemon, path: str) -> str:
    """A data-plane URL of an in-process daemon."""
    return f"http://{d.config.server.host}:{d.config.server.port}{path}"


def admin_url(d: Daemon, path: str) -> str:
    """A control-plane URL of an in-process daemon."""
    return f"http://{d.config.admin.host}:{d.config.admin.port}{path}"


# -- the streaming client -----------------------------------------------------------------------


def http_session(**kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session without a connection limit, on the bench's pool (idle connections are dropped
    before the server's keep-alive closes them)."""
    return aiohttp.ClientSession(connector=pooled_connector(0), **kwargs)


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    max_tokens: int,
    priority: int = 0,
    prompt: str = "",
    model: str = "tiny",
) -> dict[str, Any]:
    """One streamed /v1/completions request: status, generated tokens (from the usage chunk; a chunk
    may carry several tokens), content chunks, TTFT and when it ended. Raises a transport error."""
    body = {
        "model": model,
        "prompt": prompt or "the engine serves requests",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": priority,
    }
    answer = await post(session, base_url + "/v1/completions", body)
    if answer.failure is not None:
        raise answer.failure
    if answer.status != 200:
        return {"status": answer.status, "chunks": 0, "headers": dict(answer.headers), "body": answer.body}
    tokens = answer.usage["completion_tokens"] if answer.usage else 0
    if answer.error_event is not None:
        return {"status": 500, "chunks": answer.chunks, "tokens": tokens, "error": answer.error_event}
    first = answer.chunk_mono[0] if answer.chunk_mono else None
    done = answer.ended_mono
    return {
        "status": answer.status,
        "chunks": answer.chunks,
        "tokens": tokens,
        "start_mono": answer.sent_mono,
        "first_token_mono": first,
        "done_mono": done,
        "ttft_s": (first or done) - answer.sent_mono,
    }


# -- the gate -----------------------------------------------------------------------------------


async def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def engine_core() -> psutil.Process:
    """The EngineCore process under this test process (the in-process daemon's engine)."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
    raise AssertionError("no EngineCore child process found")


async def settle() -> None:
    """Let every ready task run until it blocks again (a few loop iterations, no real time)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def until(condition: Callable[[], bool], turns: int = 10_000) -> None:
    """Turn the loop until ``condition`` holds (each turn a ``sleep(0)``: no real time passes on the
    test's side); fail after ``turns`` turns."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"still false after {turns} turns of the loop")


class Events:
    """Records the gate's per-class events."""

    def __init__(self) -> None:
        self.admitted: list[tuple[str, float]] = []
        self.rejected: list[tuple[str, str]] = []
        self.timed_out: list[tuple[str, float]] = []


class Recorder:
    """The gate's event sink for tests: refusal reasons in order, and every event by class."""

    def __init__(self, reasons: list[str], events: Events) -> None:
        self.reasons = reasons
        self.events = events

    def admitted(self, cls: str, wait_s: float) -> None:
        self.events.admitted.append((cls, wait_s))

    def rejected(self, cls: str, reason: str) -> None:
        self.reasons.append(reason)
        self.events.rejected.append((cls, reason))

    def timed_out(self, cls: str, wait_s: float) -> None:
        self.events.timed_out.append((cls, wait_s))


class FakeBuiltEngine:
    """What the engine host holds of a built ``AsyncLLM``, for host tests with a fake builder: a
    renderer (with ``tokenizer``, recording its shutdown), an output processor, the config and an
    EngineCore client that answers the scheduler utilities."""

    errored = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.renderer_shut = False
        self.renderer = SimpleNamespace(tokenizer=tokenizer, shutdown=self._shut_renderer)
        self.output_processor = SimpleNamespace(request_states={}, abort_requests=lambda ids, internal: ids)
        self.vllm_config = SimpleNamespace(shutdown_timeout=1.0, cache_config=None)

        async def call_utility_async(_name: str, value: int) -> int:
            return value

        self.engine_core = SimpleNamespace(
            shutdown=lambda timeout=None: None, call_utility_async=call_utility_async
        )

    def _shut_renderer(self) -> None:
        self.renderer_shut = True

    def shutdown(self, timeout: float | None = None) -> None:
        pass


class FakeHost:
    """The engine host as the governed client sees it: an engine (``llm``, a fake with the tests' own
    ``generate``) and the in-flight and abort bookkeeping, keyed per attempt."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.in_flight: dict[int, tuple[str, Any]] = {}
        self.aborted: dict[int, str] = {}
        self.outcomes: Any = None


# -- observations -------------------------------------------------------------------------------

OBS_DEFAULTS: dict[str, Any] = {
    "now_mono": 0.0,
    "admission_limit": 34,
    "batch_cap": 32,
    "max_num_seqs": 64,
    "in_flight": 20,
    "queued": 0,
    "running": 20,
    "kv_usage": 0.5,
    "kv_usage_mean": 0.5,
    "kv_usage_max": 0.5,
    "preemptions_per_s": 0.0,
    "generated_tokens_per_s": 1000.0,
    "ttft_p99_s": None,
    "itl_p99_s": None,
    "stats_age_s": 0.1,
}


def obs(**overrides: Any) -> Observation:
    """An Observation of a loaded, healthy engine (cap 32 of 64, KV half full), with ``overrides``."""
    unknown = set(overrides) - set(Observation.__dataclass_fields__)
    if unknown:
        raise TypeError(f"not Observation fields: {sorted(unknown)}")
    return Observation(**{**OBS_DEFAULTS, **overrides})


OBS_IDLE: dict[str, Any] = {
    **OBS_DEFAULTS,
    "now_mono": 1000.0,
    "in_flight": 0,
    "running": 0,
    "kv_usage": 0.0,
    "kv_usage_mean": 0.0,
    "kv_usage_max": 0.0,
    "generated_tokens_per_s": 0.0,
    "stats_age_s": None,
}


def idle_obs(**overrides: Any) -> Observation:
    """An Observation of an idle engine (nothing in flight, no stats yet), with ``overrides``."""
    return obs(**{**OBS_IDLE, **overrides})


# -- the parts the gauges read (admin/metrics.LiveGauges) ------------------------------------------


class GateTotals:
    """Gate totals: ``admitted`` and ``rejected`` so far, ``queued`` now; ``arrive`` adds arrivals."""

    def __init__(self, admitted: int = 0, rejected: int = 0, queued: int = 0) -> None:
        self.admitted, self.rejected, self.queued = admitted, rejected, queued
        self.ttft_check = TtftCheck(time.monotonic)  # no TTFT measured: the gauges show no class

    def arrive(self, n: int, refused: int = 0) -> None:
        self.admitted += n - refused
        self.rejected += refused

    def stats(self) -> GateStats:
        arrivals = self.admitted + self.rejected + self.queued  # each counted once, as it arrives
        return GateStats(8, 0, self.queued, 0, self.admitted, self.rejected, 0, False, 0, arrivals)

    def queued_by_class(self) -> dict[str, int]:
        return {"default": self.queued}


@dataclasses.dataclass
class EngineKnobsInForce:
    """An engine host's knobs as the gauges read them (``admin/metrics.LiveEngine``)."""

    batch_cap: int = 8
    max_num_seqs: int = 64
    token_budget: int = 512
    max_num_batched_tokens: int = 2048
    token_budget_min: int = 16
    generation: int = 1
    ready: bool = True


@dataclasses.dataclass
class Steering:
    """``[slo]`` and the policy in force, as the capacity meter reads them (the control core)."""

    slo: SloTargets | None
    policy: Policy


@dataclasses.dataclass
class PolicyHolder:
    """What holds the policy in force (the control loop, for the gauges)."""

    policy: Policy
