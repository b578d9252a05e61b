"""``bench chaos``: our daemon under steady mixed-priority load while faults hit it, then the invariants.

It starts the daemon from ``--config`` (with the overrides), runs the load of ``load`` for
``--duration`` seconds while ``faults`` injects a fault every ``--fault-every`` seconds, samples
the daemon's resident memory, waits for the gate to empty, sends one last request, stops the daemon and
looks for what it left behind. ``verdict`` checks the invariants; the report goes to
``OUT/chaos.json`` and the exit status is 0 only when every invariant holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from controller.bench.chaos.faults import Injector, engine_core_alive, http_get, inject_faults
from controller.bench.chaos.load import LoadShape, Sender, run_load
from controller.bench.chaos.verdict import ChaosVerdictLimits, EndState, verdict
from controller.bench.servers import Launched, ServerSpec, launched, served_model
from controller.bench.targets import add_config_args, base_config
from controller.load.client import Target

RESULT = "chaos.json"
SHM = Path("/dev/shm")
CHAOS_GUARD = {"max_restarts_per_hour": 1000}
"""The soak kills the engine on purpose, so the crash budget must not end it (its own test covers it)."""


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
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of RSS left out of the fit")
    p.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed RSS rise (default 0.10)")
    p.add_argument("--seed", type=int, default=0)


def _deadlines(server: Launched, allowance_s: float) -> Callable[[int], float]:
    """Each priority's deadline, from the daemon's own parse of the config it runs."""
    from controller.config.load import load_config

    assert server.config_path is not None
    config = load_config(server.config_path)
    restart_wait = config.guard.max_restart_wait_s

    def deadline_for(priority: int) -> float:
        queue = next((c.queue_deadline_s for c in config.admission.classes if c.contains(priority)), 60.0)
        return queue + restart_wait + allowance_s

    return deadline_for


def _rss(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


async def _sample(server: Launched, injector: Injector, end: EndState, t0: float) -> None:
    while True:
        rss = await asyncio.to_thread(_rss, server.pid)
        if rss is not None:
            end.rss.append((round(time.monotonic() - t0, 1), rss))
        await asyncio.to_thread(injector.watch_engines)
        await asyncio.sleep(2.0)


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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (await asyncio.to_thread(http_get, f"{admin}/healthz"))[0] != 200:
        await asyncio.sleep(1.0)
    target = Target(server.base_url, served_model(server.spec.engine))
    async with aiohttp.ClientSession() as session:
        out = await Sender(session, target, shape, time.monotonic()).send(
            "stream", 0, "one last request", 120.0, "final"
        )
    return out.end == "completed", f"{out.end} {out.status or ''} {out.detail}".strip()


async def _soak(server: Launched, args: argparse.Namespace, end: EndState) -> tuple[list[Any], Injector]:
    shape = LoadShape(rate=args.rate, output_tokens=args.output_tokens)
    deadline_for = await asyncio.to_thread(_deadlines, server, args.allowance)  # imports vLLM: seconds
    injector = Injector(server, args.recovery_timeout)
    sampler = asyncio.create_task(_sample(server, injector, end, injector.t0))
    target = Target(server.base_url, served_model(server.spec.engine))
    try:
        outcomes, _ = await asyncio.gather(
            run_load(target, shape, args.duration, deadline_for, args.seed, str(server.state_url)),
            inject_faults(injector, args.duration, args.fault_every),
        )
        print(
            f"chaos: load stopped after {time.monotonic() - injector.t0:.0f} s; {len(outcomes)} requests",
            flush=True,
        )
        end.gate = await _gate_settles(str(server.state_url), 60.0)
        end.served_at_end, end.final_detail = await _serves(server, shape, args.recovery_timeout)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    return outcomes, injector


def _held_files() -> set[str]:
    """Every /dev/shm path some process has open or mapped."""
    held: set[str] = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            held.update(f.path for f in proc.open_files() if f.path.startswith(str(SHM)))
            held.update(m.path for m in proc.memory_maps() if m.path.startswith(str(SHM)))
    return held


def _shm_orphans(before: set[str]) -> list[str]:
    if not SHM.is_dir():
        return []
    new = {str(SHM / n) for n in os.listdir(SHM)} - before
    return sorted(new - _held_files()) if new else []


def main(args: argparse.Namespace) -> int:
    base = base_config(args)
    base["guard"] = {**CHAOS_GUARD, **(base.get("guard") or {})}
    spec = ServerSpec("chaos", "daemon", base["engine"])
    shm_before = {str(SHM / n) for n in os.listdir(SHM)} if SHM.is_dir() else set()
    end = EndState()
    args.out.mkdir(parents=True, exist_ok=True)
    with launched(spec, base, args.out / "logs", startup_timeout_s=args.startup_timeout) as server:
        print(f"chaos: daemon healthy after {server.startup_s:.0f} s (log {server.log})", flush=True)
        outcomes, injector = asyncio.run(_soak(server, args, end))
    end.exit_code, end.killed_leftovers = server.exit_code, server.killed
    end.engine_cores_alive = sorted(p for p in injector.engine_pids if engine_core_alive(p))
    end.shm_orphans = _shm_orphans(shm_before)
    limits = ChaosVerdictLimits(args.warmup, args.max_rss_growth)
    passed, reasons, figures = verdict(outcomes, injector.records, end, limits)
    report = {
        "passed": passed,
        "reasons": reasons,
        "figures": figures,
        "duration_s": args.duration,
        "rate": args.rate,
        "fault_every_s": args.fault_every,
        "limits": asdict(limits),
        "faults": [f.as_dict() for f in injector.records],
        "outcomes": [o.as_dict() for o in outcomes],
        "rss": end.rss,
    }
    (args.out / RESULT).write_text(json.dumps(report, indent=2) + "\n")
    print(f"chaos {'PASSED' if passed else 'FAILED'}" + "".join(f"\n  - {r}" for r in reasons))
    print(json.dumps(figures, indent=2))
    return 0 if passed else 1
