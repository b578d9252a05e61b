"""``bench chaos``: our daemon under steady mixed-priority load while faults and hostile clients hit
it, then the invariants.

It starts the daemon from ``--config`` (with the overrides and :data:`CHAOS_GUARD`), and for
``--duration`` seconds runs at once: the load of ``load``, its probe (one ordinary request every
``--probe-every`` seconds), a fault of ``faults`` every ``--fault-every`` seconds and a hostile client
of ``hostile`` every ``--hostile-every`` seconds. Every 2 s it samples the daemon's resident memory,
open files and threads and the control loop's tick count. Then it waits for the gate to empty,
counts what the daemon holds, sends one last request, stops the daemon and looks for what it left
behind. ``verdict`` checks the invariants; the run prints their table, the report goes to
``OUT/chaos.json`` and the exit status is 0 only when every invariant holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import psutil

from controller.bench.chaos.faults import (
    Injector,
    engine_core_alive,
    engine_cores,
    http_get,
    inject_faults,
    tick_count,
)
from controller.bench.chaos.hostile import HostileRecord, HostileShape, run_hostile
from controller.bench.chaos.load import ChaosOutcome, LoadShape, Sender, run_load, run_probe
from controller.bench.chaos.verdict import ChaosVerdictLimits, EndState, verdict
from controller.bench.servers import Launched, ServerSpec, launched, served_model
from controller.bench.targets import add_config_args, base_config
from controller.load.client import Target

if TYPE_CHECKING:
    from controller.config.load import Config

RESULT = "chaos.json"
SHM = Path("/dev/shm")
CHAOS_GUARD = {"max_restarts_per_hour": 1000, "stall_timeout_s": 20.0}
"""The soak kills the engine on purpose, so the crash budget must not end it (its own test covers
it); a hung engine is found after 20 s rather than the default 60 (no step of a model this bench runs
takes 20 s). A ``[guard]`` table of the config wins."""
SAMPLE_S = 2.0
"""Seconds between two samples of the daemon (memory, files, threads, ticks)."""
SHM_GRACE_S = 10.0
"""How long after the daemon exited a /dev/shm file it left may still be unlinked by its resource
tracker before it counts as orphaned."""
FINAL_WAIT_S = 120.0
"""How long the last request waits for ``/healthz`` to say the daemon serves (each fault has ended,
its rebuild included, when the load stops); then it is sent all the same."""


def add_parser(cmds: Any) -> None:
    p = cmds.add_parser(
        "chaos", help="faults under load (engine kills, bad reloads, rude clients) -> invariants"
    )
    add_config_args(p)
    p.add_argument("--out", type=Path, required=True, help="directory for the report and the daemon's log")
    p.add_argument("--duration", type=float, required=True, help="seconds of load and faults")
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (default 2)")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults (default 30)")
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=600.0,
        help="seconds an engine rebuild after a kill may take (default 600)",
    )
    p.add_argument(
        "--allowance",
        type=float,
        default=120.0,
        help="a request's deadline is its class's queue deadline + [guard] max_restart_wait_s "
        "+ this (default 120 s)",
    )
    p.add_argument(
        "--hostile-every",
        type=float,
        default=30.0,
        help="seconds between hostile clients (idle, slow, endless, stalled; default 30)",
    )
    p.add_argument(
        "--hostile-hold",
        type=float,
        default=120.0,
        help="seconds a hostile client holds a connection the daemon has not ended (default 120)",
    )
    p.add_argument("--probe-every", type=float, default=2.0, help="seconds between probes (default 2)")
    p.add_argument(
        "--min-probe-served",
        type=float,
        default=0.8,
        help="share of the probes outside engine rebuilds that must be served (default 0.8)",
    )
    p.add_argument(
        "--max-tick-gap",
        type=float,
        default=15.0,
        help="longest stretch without a control-loop tick outside engine rebuilds (default 15 s)",
    )
    p.add_argument(
        "--warmup", type=float, default=60.0, help="seconds of RSS, files and threads left out (default 60)"
    )
    p.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed RSS rise (default 0.10)")
    p.add_argument("--max-fd-growth", type=int, default=64, help="allowed rise of open files (default 64)")
    p.add_argument("--max-thread-growth", type=int, default=16, help="allowed rise of threads (default 16)")
    p.add_argument("--seed", type=int, default=0)


def _daemon_config(server: Launched) -> Config:
    """The daemon's own parse of the config it runs (imports vLLM: seconds)."""
    from controller.config.load import load_config

    assert server.config_path is not None
    return load_config(server.config_path)


def _deadlines(config: Config, allowance_s: float) -> Callable[[int], float]:
    """Each priority's deadline."""
    restart_wait = config.guard.max_restart_wait_s

    def deadline_for(priority: int) -> float:
        queue = next((c.queue_deadline_s for c in config.admission.classes if c.contains(priority)), 60.0)
        return queue + restart_wait + allowance_s

    return deadline_for


def _held(pid: int) -> tuple[int, int, int] | None:
    """The daemon process's (resident bytes, open file descriptors, threads)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return int(proc.memory_info().rss), proc.num_fds(), proc.num_threads()
    except psutil.Error:
        return None


def _state(server: Launched) -> dict[str, Any]:
    status, body = http_get(str(server.state_url))
    return json.loads(body) if status == 200 else {}


def _demand(server: Launched) -> int | None:
    """The gate's new demand so far: its arrivals less the retries of refused requests."""
    gate = _state(server).get("gate") or {}
    arrivals, retries = gate.get("arrivals_total"), gate.get("retries_total")
    return None if arrivals is None or retries is None else int(arrivals) - int(retries)


async def _sample(server: Launched, injector: Injector, end: EndState, t0: float) -> None:
    while True:
        t = round(time.monotonic() - t0, 1)
        held = await asyncio.to_thread(_held, server.pid)
        if held is not None:
            end.rss.append((t, held[0]))
            end.fds.append((t, held[1]))
            end.threads.append((t, held[2]))
        end.ticks.append((t, tick_count(await asyncio.to_thread(_state, server))))
        await asyncio.to_thread(injector.watch_engines)
        await asyncio.sleep(SAMPLE_S)


async def _after_load(server: Launched, end: EndState) -> None:
    """What the daemon holds once the load and the hostile clients ended and the gate settled."""
    held = await asyncio.to_thread(_held, server.pid)
    if held is not None:
        _, end.fds_end, end.threads_end = held
    end.engine_cores_end = len(await asyncio.to_thread(engine_cores, server.pid))


async def _gate_settles(state_url: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    gate: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status, body = await asyncio.to_thread(http_get, state_url)
        if status == 200:
            gate = json.loads(body).get("gate") or {}
            if not any(gate.get(k) for k in ("in_flight", "queue_depth", "pending")):
                break
        await asyncio.sleep(1.0)
    return gate


async def _serves(server: Launched, shape: LoadShape, timeout_s: float) -> tuple[bool, str]:
    admin = str(server.state_url).rsplit("/", 1)[0]
    deadline = time.monotonic() + min(timeout_s, FINAL_WAIT_S)
    while time.monotonic() < deadline and (await asyncio.to_thread(http_get, f"{admin}/healthz"))[0] != 200:
        await asyncio.sleep(1.0)
    target = Target(server.base_url, served_model(server.spec.engine))
    async with aiohttp.ClientSession() as session:
        out = await Sender(session, target, shape, time.monotonic()).send(
            "stream", 0, "one last request", 120.0, "final"
        )
    return out.end == "completed", f"{out.end} {out.status or ''} {out.detail}".strip()


@dataclass
class Soaked:
    """What the soak recorded, besides ``EndState``."""

    outcomes: list[ChaosOutcome]
    """The load's requests and the probes."""
    injector: Injector
    hostile: list[HostileRecord]


async def _soak(server: Launched, args: argparse.Namespace, end: EndState) -> Soaked:
    shape = LoadShape(rate=args.rate, output_tokens=args.output_tokens)
    config = await asyncio.to_thread(_daemon_config, server)
    deadline_for = _deadlines(config, args.allowance)
    model = served_model(server.spec.engine)
    injector = Injector(server, args.recovery_timeout, model=model)
    t0 = injector.t0
    end.demand_start = await asyncio.to_thread(_demand, server)
    sampler = asyncio.create_task(_sample(server, injector, end, t0))
    target = Target(server.base_url, model)
    url = urllib.parse.urlsplit(server.base_url)
    hostile_shape = HostileShape(hold_s=args.hostile_hold)
    try:
        outcomes, probes, _, hostile = await asyncio.gather(
            run_load(target, shape, args.duration, deadline_for, args.seed, str(server.state_url), t0),
            run_probe(target, shape, args.duration, args.probe_every, deadline_for(0), t0),
            inject_faults(injector, args.duration, args.fault_every),
            run_hostile(
                url.hostname or "127.0.0.1",
                url.port or 80,
                hostile_shape,
                args.duration,
                args.hostile_every,
                t0,
                config.server.max_connections,
            ),
        )
        print(
            f"chaos: load stopped after {time.monotonic() - t0:.0f} s; {len(outcomes)} requests, "
            f"{len(probes)} probes",
            flush=True,
        )
        end.gate = await _gate_settles(str(server.state_url), 60.0)
        await _after_load(server, end)
        end.served_at_end, end.final_detail = await _serves(server, shape, args.recovery_timeout)
        end.demand_end = await asyncio.to_thread(_demand, server)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    return Soaked(outcomes + probes, injector, hostile)


def _held_files() -> set[str]:
    """Every /dev/shm path some process has open or mapped."""
    held: set[str] = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            held.update(f.path for f in proc.open_files() if f.path.startswith(str(SHM)))
            held.update(m.path for m in proc.memory_maps() if m.path.startswith(str(SHM)))
    return held


def _unheld(before: set[str]) -> set[str]:
    new = {str(SHM / n) for n in os.listdir(SHM)} - before
    return new - _held_files() if new else set()


def _shm_orphans(before: set[str], grace_s: float = SHM_GRACE_S) -> list[str]:
    """The /dev/shm files that appeared since ``before`` and that no process holds ``grace_s`` after
    the daemon exited: its multiprocessing resource tracker (a process of its own) unlinks what
    vLLM's engines left registered a moment after the daemon itself is gone."""
    if not SHM.is_dir():
        return []
    deadline = time.monotonic() + grace_s
    while (left := _unheld(before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return sorted(left)


def _interrupted(signum: int, _frame: object) -> None:
    """SIGTERM (a ``timeout`` around the bench, a CI job's end) unwinds as Ctrl-C does, so the daemon
    the run started is stopped with it rather than left serving on its own."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    base = base_config(args)
    base["guard"] = {**CHAOS_GUARD, **(base.get("guard") or {})}
    spec = ServerSpec("chaos", "daemon", base["engine"])
    shm_before = {str(SHM / n) for n in os.listdir(SHM)} if SHM.is_dir() else set()
    end = EndState()
    args.out.mkdir(parents=True, exist_ok=True)
    with launched(spec, base, args.out / "logs", startup_timeout_s=args.startup_timeout) as server:
        print(f"chaos: daemon healthy after {server.startup_s:.0f} s (log {server.log})", flush=True)
        soaked = asyncio.run(_soak(server, args, end))
    end.exit_code, end.killed_leftovers = server.exit_code, server.killed
    end.engine_cores_alive = sorted(p for p in soaked.injector.engine_pids if engine_core_alive(p))
    end.shm_orphans = _shm_orphans(shm_before)
    limits = ChaosVerdictLimits(
        args.warmup,
        args.max_rss_growth,
        args.min_probe_served,
        args.max_tick_gap,
        args.max_fd_growth,
        args.max_thread_growth,
    )
    result = verdict(soaked.outcomes, soaked.injector.records, end, limits, soaked.hostile)
    report = {
        "passed": result.passed,
        "reasons": result.reasons,
        "invariants": [i.as_dict() for i in result.invariants],
        "figures": result.figures,
        "duration_s": args.duration,
        "rate": args.rate,
        "fault_every_s": args.fault_every,
        "hostile_every_s": args.hostile_every,
        "probe_every_s": args.probe_every,
        "limits": asdict(limits),
        "faults": [f.as_dict() for f in soaked.injector.records],
        "hostile": [h.as_dict() for h in soaked.hostile],
        "outcomes": [o.as_dict() for o in soaked.outcomes],
        "rss": end.rss,
        "fds": end.fds,
        "threads": end.threads,
        "ticks": end.ticks,
    }
    (args.out / RESULT).write_text(json.dumps(report, indent=2) + "\n")
    print(result.table())
    print(f"chaos {'PASSED' if result.passed else 'FAILED'}" + "".join(f"\n  - {r}" for r in result.reasons))
    print(json.dumps(result.figures, indent=2))
    return 0 if result.passed else 1
