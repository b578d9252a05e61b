"""The closed loop on the real engine, with a KV cache small enough that the full batch cap
overflows it and preempts (2 MiB: 4096 tokens; 48 requests of ~300 tokens need 3.5x that).

For each of ``pid`` and ``hysteresis``: repeated bursts make the policy lower the cap with a reason,
the last four bursts preempt on average at most a third as often as the first, the cap comes back up
once the load is gone, and at steady load the cap changes direction at most twice a minute. Burst
durations are printed, not asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, stream_completion, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPT = " ".join(["engine"] * 30)
BURST, TOKENS = 48, 256
POLICIES: dict[str, dict[str, Any]] = {
    # The policies' defaults (KV usage read as the window max, PID with log output and a deadband),
    # except what scales with this test's short window: hysteresis waits 2 s between steps (5 s by
    # default) and 3.5 s between cuts (10 s), with steps of 2 (max_num_seqs // 16 = 4); and the
    # load goes away for 5 s, not 60, before the cap is restored.
    "hysteresis": {
        "params": {"step": 2, "cooldown_s": 2.0, "cut_cooldown_s": 3.5, "idle_restore_s": 5.0},
    },
    "pid": {
        "params": {"idle_restore_s": 5.0},
        "tolerance": 0.25,  # the shared normalize stage keeps +-1 jitter from reaching the engine
    },
}  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=sorted(POLICIES))
async def daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> AsyncIterator[Daemon]:
    policy = request.param
    path = write_config(
        tmp_path_factory.mktemp(policy) / "config.toml",
        engine={"kv_cache_memory_bytes": 2 << 20, "max_num_seqs": 64},
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
        control={"tick_seconds": 0.5, "window_seconds": 3.0, "policy": policy, **POLICIES[policy]},
    )
    async with running_daemon(path) as d:
        yield d


def base(d: Daemon) -> str:
    return f"http://{d.config.server.host}:{d.config.server.port}"


async def burst(s: aiohttp.ClientSession, d: Daemon) -> tuple[float, int]:
    """(duration, preemptions) of one burst; every request must complete."""
    p0, t0 = d.parts.window.total_preemptions, time.monotonic()
    results = await asyncio.gather(
        *(stream_completion(s, base(d), TOKENS, prompt=PROMPT) for _ in range(BURST))
    )
    assert all(r["status"] == 200 and r["tokens"] == TOKENS for r in results)
    return time.monotonic() - t0, d.parts.window.total_preemptions - p0


QUIET_S = 10.0
""""Steady" starts once the policy has left both knobs alone this long (it has converged)."""


async def quiet(d: Daemon, quiet_s: float, timeout_s: float) -> float:
    """Wait until no knob changed for ``quiet_s`` (at most ``timeout_s``: a policy that never settles
    then shows it in the minute measured after); the seconds waited. pid, from the full cap, cut in
    3 s steps to ~9 and then crossed its band 4 times before holding at 11 in one run (35 s), where
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


async def test_bursts_lower_cap_and_preemptions_then_idle_restores(daemon: Daemon) -> None:
    d = daemon
    ceiling = d.parts.host.max_num_seqs
    runs = []
    async with http_session() as s:
        for _ in range(8):
            runs.append(await burst(s, d))
            await asyncio.sleep(0.5)
    cuts = [c for c in d.parts.loop.history if c.knob == "batch_cap" and c.new < c.old]
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
    # Duration is reported, not asserted (timings on this shared 2-core machine are noisy): the
    # last burst took 1.16x-1.52x the first here, since preemption by recompute is cheap for the tiny
    # model and the full cap runs more requests at once early in a burst (docs/benchmarks.md).
    print(f"{d.config.control.policy}: last burst took {last_s / first_s:.2f}x the first")
    await asyncio.sleep(d.parts.loop.policy.params()["idle_restore_s"] + 2.0)  # the load is gone
    assert d.parts.host.batch_cap == ceiling, d.parts.loop.recent()[-3:]
    assert d.parts.loop.history[-1].reason == "idle_restore"


async def test_steady_load_changes_direction_at_most_twice_a_minute(daemon: Daemon) -> None:
    d = daemon
    stop = asyncio.Event()

    async def client(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            r = await stream_completion(s, base(d), TOKENS, prompt=PROMPT)
            assert r["status"] == 200

    caps: list[int] = []
    async with http_session() as s:
        clients = [asyncio.create_task(client(s)) for _ in range(24)]
        await asyncio.sleep(20.0)  # the load ramps up and the first cuts land
        settled_s = await quiet(d, QUIET_S, timeout_s=60.0)
        t_end = time.monotonic() + 60.0
        while time.monotonic() < t_end:
            caps.append(d.parts.host.batch_cap)
            await asyncio.sleep(0.25)
        stop.set()
        await asyncio.gather(*clients)
    changes = direction_changes(caps)
    print(
        f"{d.config.control.policy}: no knob change for {QUIET_S:g} s after {20 + settled_s:.0f} s; "
        f"steady minute caps {sorted(set(caps))}, direction changes {changes}"
    )
    assert changes <= 2
