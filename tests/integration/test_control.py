"""The closed loop on the real engine (the tiny model on config.toml's engine table, in float32 and
without prefix caching on every box), with a KV cache small enough that the full batch cap overflows
it and preempts: 48 blocks of 32 tokens (1,536 tokens; with vLLM-CPU's default block of 128 tokens
every request here would stay one block, never grow, and nothing would preempt). A request is a
24-token prompt and 48 forced tokens: one block when admitted, three at its end, so the full cap
admits a burst of 48 at once and then preempts them as they grow, while a cap of 16 holds them all.
The tiny model, not SmolLM2: what is tested is the policies' steering of vLLM's cache and scheduler,
which the model's speed does not change, and on SmolLM2 the module took 12 of the suite's 52 minutes
on a slow hour (SmolLM2's burst timings, where recomputing a preempted request is real prefill work,
are in docs/benchmarks.md, section 2).

For each of ``pid`` and ``hysteresis`` (one engine; the policy switched by a reload once the cap is
back at its ceiling): repeated bursts make the policy lower the cap with a reason, the last four
bursts preempt on average at most a third as often as the first, the cap comes back up once the load
is gone, and at steady load the cap changes direction at most twice a minute. Burst durations are
printed, not asserted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import (
    http_session,
    running_daemon,
    shipped_config,
    stream_completion,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
PROMPT = " ".join(["engine"] * 24)
BURST, TOKENS = 48, 48
KV = {
    "block_size": 32,
    "kv_cache_memory_bytes": 48 * 32 * 1024,
    "max_model_len": 512,
    "dtype": "float32",
    "enable_prefix_caching": False,
}
"""48 blocks of 32 tokens (1 KiB of float32 KV a token: 2 layers, 2 KV heads of 32); vLLM refuses a
cache smaller than one request of ``max_model_len``. float32 on every box (config.toml's dtype
resolves per CPU, and bf16 would hold twice the tokens), and no prefix caching: every request here
is the same prompt and the same greedy tokens, so with caching on they would share their full
blocks and nothing would fill the cache."""
POLICIES: dict[str, dict[str, Any]] = {
    # The policies' defaults (KV usage read as the window max, PID with log output and a deadband),
    # except what scales with this test's short window: hysteresis reads a 3 s window, waits 2 s
    # between steps (5 s by default) and 3.5 s between cuts (10 s), with steps of 2 (max_num_seqs // 16
    # = 4); and the load goes away for 5 s, not 60, before the cap is restored. pid reads config.toml's
    # 10 s window: over 3 s the KV max swung with each request's block crossings and pid followed it
    # (caps 8-14 and 11-21, 6 direction changes in the steady minute, in two runs).
    "hysteresis": {
        "params": {"step": 2, "cooldown_s": 2.0, "cut_cooldown_s": 3.5, "idle_restore_s": 5.0},
    },
    "pid": {
        "window_s": 10.0,
        "params": {"idle_restore_s": 5.0},
        # the shared normalize stage keeps +-1 jitter from reaching the engine; 0.25 made every move
        # a jump of a quarter, wider than the caps the deadband spans here, so the cap jumped over it
        # (12 -> 16 -> 11 -> 16, a 20 s cycle)
        "tolerance": 0.1,
    },
}  # fmt: skip


def write_control_config(path: Path, model: Path, policy: str, ports: tuple[int, int] | None = None) -> Path:
    """config.toml's engine table with the small KV above, under ``policy``; ``ports`` (data plane,
    control plane) keep a running daemon's, so that a reload changes only the policy."""
    ports_tables = {} if ports is None else {"server": {"port": ports[0]}, "admin": {"port": ports[1]}}
    return write_config(
        path,
        engine={
            **shipped_config()["engine"],
            "model": str(model),
            "served_model_name": [MODEL],
            "max_num_seqs": 64,
            **KV,
        },
        # the bursts test the batch cap, not admission: every request must be served, so the class
        # deadlines are long (with the default 5 s, a burst queued behind a cut limit gets early 429s)
        admission={
            "limit": 64,
            "max_queue": 512,
            "classes": {
                "interactive": {"max_priority": 0, "max_queue": 512, "queue_deadline_s": 600.0},
                "batch": {"min_priority": 1, "queue_deadline_s": 600.0},
            },
        },
        control={
            "tick_s": 0.5,
            "window_s": 3.0,
            "history": 1000,
            "policy": policy,
            **POLICIES[policy],
        },
        **ports_tables,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_control_config(tmp_path_factory.mktemp("control") / "config.toml", tiny_model, min(POLICIES))
    async with running_daemon(path) as d:
        yield d


@dataclasses.dataclass(frozen=True)
class Run:
    """The daemon under one policy, and since when that policy steers (its history starts there)."""

    d: Daemon
    since_mono: float


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=sorted(POLICIES))
async def run(request: pytest.FixtureRequest, engine: Daemon, tiny_model: Path) -> Run:
    d, policy = engine, request.param
    if d.config.control.policy != policy:
        # the previous policy's idle restore puts the cap back at its ceiling once its load is gone
        await wait_for(
            lambda: d.parts.host.batch_cap == d.parts.host.max_num_seqs, 30.0, "the cap's idle restore"
        )
        ports = (d.config.server.port, d.config.admin.port)
        write_control_config(d.config.path, tiny_model, policy, ports)
        result = await d.reloader.reload()
        assert result["ok"] and d.config.control.policy == policy, result
    return Run(d, time.monotonic())


def base(d: Daemon) -> str:
    return f"http://{d.config.server.host}:{d.config.server.port}"


async def burst(s: aiohttp.ClientSession, d: Daemon) -> tuple[float, int]:
    """(duration, preemptions) of one burst; every request must complete."""
    p0, t0 = d.parts.window.total_preemptions, time.monotonic()
    results = await asyncio.gather(
        *(stream_completion(s, base(d), TOKENS, prompt=PROMPT, model=MODEL) for _ in range(BURST))
    )
    assert all(r["status"] == 200 and r["tokens"] == TOKENS for r in results)
    return time.monotonic() - t0, d.parts.window.total_preemptions - p0


BURST_GAP_S, BURSTS_S = 3.0, 75.0
"""Bursts, at least eight, come every ``BURST_GAP_S`` for ``BURSTS_S``: a burst of the tiny model
takes about a second, and pid cuts at most once a window (10 s, ``cut_dwell``) by a step its gains
size, so eight bursts back to back ended at its first cut (64 -> 27, the last four preempting 22
each as the first 39) and eight 3 s apart at its third (21, 12 each); the gap stays below
``idle_restore_s`` (5 s), so the load does not count as gone."""


STEADY_CLIENTS = 24
"""Closed-loop clients of the steady load. On the tiny model a stream spends as long in the front end
as in a step, so fewer of them are in the engine at once than on SmolLM2: hysteresis holds 16 (its
KV window at 3 s sees them fill the cache), pid's 10 s window at times does not, and its minute is
a climb (caps 26-57 in two runs, 17-27 in one with 40 clients), as on SmolLM2 it was a descent."""


QUIET_S = 10.0
""""Steady" starts once the policy has left both knobs alone this long (it has converged)."""


async def quiet(d: Daemon, quiet_s: float, timeout_s: float) -> float:
    """Wait until no knob changed for ``quiet_s`` (at most ``timeout_s``: a policy that never settles
    then shows it in the minute measured after); the seconds waited. pid, from the full cap, may cross
    its band a few times before it holds: 35 s in one run of an earlier version of this test, where
    other runs held within 20 s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        last = max((c.t_mono for c in d.parts.loop.history), default=-float("inf"))
        if time.monotonic() - last >= quiet_s:
            break
        await asyncio.sleep(0.5)
    return time.monotonic() - t0


def direction_changes(caps: list[int]) -> int:
    moves = [b - a for a, b in itertools.pairwise(caps) if b != a]
    return sum(1 for x, y in itertools.pairwise(moves) if (x > 0) != (y > 0))


async def test_bursts_lower_cap_and_preemptions_then_idle_restores(run: Run) -> None:
    d = run.d
    ceiling = d.parts.host.max_num_seqs
    runs = []
    async with http_session() as s:
        t0 = time.monotonic()
        while len(runs) < 8 or time.monotonic() - t0 < BURSTS_S:
            runs.append(await burst(s, d))
            await asyncio.sleep(BURST_GAP_S)
    mine = [c for c in d.parts.loop.history if c.t_mono >= run.since_mono]
    cuts = [c for c in mine if c.knob == "batch_cap" and c.new < c.old]
    print(
        f"{d.config.control.policy}: bursts (s, preemptions) {[(round(t, 2), p) for t, p in runs]}; "
        f"cap now {d.parts.host.batch_cap}; cuts {[(c.old, c.new, c.reason) for c in cuts]}"
    )
    assert cuts and all(c.reason for c in cuts)
    (first_s, first_p), (last_s, _) = runs[0], runs[-1]
    assert first_p > 0, "the workload must overflow the KV cache at the full cap"
    # The mean of the last four bursts, not the last alone: pid keeps probing upwards between bursts,
    # so one late burst can preempt a quarter as often as the first (30, 10, 12, 13, 0, 1, 9, 7 in one
    # clean-clone run) while the load as a whole preempts far less.
    later = sum(p for _, p in runs[-4:]) / 4
    assert later * 3 <= first_p, runs
    # Duration is reported, not asserted (timings on this shared 2-core machine are noisy): on SmolLM2
    # the preemption-free cap served the burst about as fast as the full cap with its recomputation
    # (0.92x-1.18x the first burst's time; docs/benchmarks.md, section 2); on the tiny model, whose
    # recomputation costs next to nothing, the smaller cap takes 1.4-1.5x.
    print(f"{d.config.control.policy}: last burst took {last_s / first_s:.2f}x the first")
    idle_s = d.parts.loop.policy.params()["idle_restore_s"]
    await wait_for(lambda: d.parts.host.batch_cap == ceiling, idle_s + 30.0, "the cap's idle restore")
    assert d.parts.loop.history[-1].reason == "idle_restore", d.parts.loop.recent()[-3:]


async def test_steady_load_changes_direction_at_most_twice_a_minute(run: Run) -> None:
    d = run.d
    stop = asyncio.Event()

    async def client(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            r = await stream_completion(s, base(d), TOKENS, prompt=PROMPT, model=MODEL)
            assert r["status"] == 200

    def cuts_since(t0: float) -> int:
        return sum(c.knob == "batch_cap" and c.new < c.old and c.t_mono >= t0 for c in d.parts.loop.history)

    caps: list[int] = []
    async with http_session() as s:
        t0 = time.monotonic()
        clients = [asyncio.create_task(client(s)) for _ in range(STEADY_CLIENTS)]
        await wait_for(lambda: cuts_since(t0) > 0, 60.0, "the load to ramp up and the first cut to land")
        ramp_s = time.monotonic() - t0
        settled_s = await quiet(d, QUIET_S, timeout_s=60.0)
        t_end = time.monotonic() + 60.0
        while time.monotonic() < t_end:
            caps.append(d.parts.host.batch_cap)
            await asyncio.sleep(0.25)
        stop.set()
        await asyncio.gather(*clients)
    changes = direction_changes(caps)
    print(
        f"{d.config.control.policy}: no knob change for {QUIET_S:g} s after {ramp_s + settled_s:.0f} s; "
        f"steady minute caps {sorted(set(caps))}, direction changes {changes}"
    )
    assert changes <= 2
