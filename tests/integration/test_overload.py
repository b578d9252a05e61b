"""Admission under overload on the real engine and the real model (SmolLM2 as config.toml serves
it, in the dtype it resolves to on this box): the daemon as a subprocess (its memory is its own),
driven open-loop at several times what it sustains, 30% interactive and 70% batch requests.

Interactive requests are served within a TTFT SLO set from the unloaded TTFT measured here; the
excess is refused with 429 + Retry-After; nothing answers 5xx; nobody waits in the gate past its
class's deadline; the daemon's RSS stays flat. Also: a client that disconnects while queued leaves
the queue, and bad requests keep vLLM's own 4xx answers under the gate.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from controller.bench.experiments.mix import (
    BATCH,
    INTERACTIVE,
    Mix,
    capacity,
    run_mix,
    summarize,
    unloaded_ttft,
)
from tests.helpers import daemon_process, free_port, http_session, shipped_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LIMIT = 8
RESERVED = 4  # interactive's reserved share 0.5 of LIMIT: batch never holds those
INTERACTIVE_DEADLINE_S = 2.5  # histogram bucket bounds, so the deadline check reads them exactly
BATCH_DEADLINE_S = 10.0
SLO_FACTOR = 40.0
"""Interactive TTFT SLO = this many times the unloaded TTFT, at least 400 ms: on this 2-core machine the
load generator, the API server and the EngineCore share the CPU, so an idle server's TTFT (~0.2 s for
SmolLM2 here) says little about the front end's latency under load."""
MODEL = "smollm2"
SHAPES: dict[str, Any] = {"interactive_tokens": 8, "batch_tokens": 64}
"""Short interactive streams, longer batch jobs: 30% of the requests are interactive, a small share
of the engine's work. SmolLM2 decodes ~10 tokens a second per stream here, so a batch job runs for
about 10 s at the limit's 8 in flight: well inside the mix's 60 s timeout."""
OVERLOAD = 3.0
MIN_RATE_PER_S = 5.0
"""Offer at least this many requests per second: on a slow machine three times the sustained rate is
too few arrivals in DURATION_S for the per-class shares to mean anything (SmolLM2 sustains well under
1 request a second of this mix here, so this floor sets the rate)."""
DURATION_S = 40.0
POLL_SLEEP_S = 0.0002
"""[server] engine_poll_sleep_s: with vLLM's own spin the EngineCore and its worker hold both cores
while they generate and the API server answers in seconds (docs/benchmarks.md, section 7)."""

CLASSES = f"""
[admission.classes.interactive]
max_priority = 0
max_queue = 64
queue_deadline_s = {INTERACTIVE_DEADLINE_S}
reserved_share = 0.5

[admission.classes.batch]
min_priority = 1
max_queue = 64
queue_deadline_s = {BATCH_DEADLINE_S}
"""


class Proc:
    def __init__(self, base: str, admin: str, popen: subprocess.Popen[bytes]) -> None:
        self.base, self.admin, self.popen = base, admin, popen


def write_daemon_config(path: Path, model: Path, poll_sleep_s: float, limit: int) -> tuple[str, str]:
    """A static-policy daemon of ``model`` (SmolLM2, config.toml's engine table) on free ports with
    this admission ``limit`` (default priority classes); (data-plane URL, control-plane URL)."""
    ports = (free_port(), free_port())
    engine = shipped_config()["engine"]
    assert engine["served_model_name"] == [MODEL]
    write_config(
        path,
        engine={**engine, "model": str(model)},
        server={"port": ports[0], "shutdown_timeout_s": 10.0, "engine_poll_sleep_s": poll_sleep_s},
        admin={"port": ports[1]},
        admission={"limit": limit, "max_queue": 128, "aging_s": 5.0},
        control={"tick_s": 1.0, "policy": "static"},
    )
    return f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"


def write_overload_config(path: Path, model: Path, poll_sleep_s: float = POLL_SLEEP_S) -> tuple[str, str]:
    """This test's daemon config; (data-plane URL, control-plane URL)."""
    urls = write_daemon_config(path, model, poll_sleep_s, LIMIT)
    path.write_text(path.read_text() + CLASSES)
    return urls


@pytest.fixture(scope="module")
def daemon_proc(tmp_path_factory: pytest.TempPathFactory, smollm2_model: Path) -> Iterator[Proc]:
    path = tmp_path_factory.mktemp("overload") / "config.toml"
    base, admin = write_overload_config(path, smollm2_model)
    with daemon_process(path, admin, startup_timeout_s=900.0) as popen:
        yield Proc(base, admin, popen)


async def _metrics(proc: Proc) -> dict[str, float]:
    async with http_session() as s, s.get(proc.admin + "/metrics") as r:
        text = await r.text()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(autopilot_[^ ]+) ([0-9.e+-]+)$", text, re.M)}


async def _state(proc: Proc) -> dict[str, Any]:
    async with http_session() as s, s.get(proc.admin + "/state") as r:
        return dict(await r.json())


async def _sample_rss(pid: int, stop: asyncio.Event, every_s: float = 1.0) -> list[float]:
    process, samples = psutil.Process(pid), []
    while not stop.is_set():
        samples.append(process.memory_info().rss / 2**20)
        await asyncio.sleep(every_s)
    return samples


async def test_overload_serves_interactive_and_refuses_the_excess(daemon_proc: Proc) -> None:
    proc = daemon_proc
    base_ttft = await unloaded_ttft(proc.base, MODEL)
    slo = max(SLO_FACTOR * base_ttft, 0.4)
    shape = Mix(rate_per_s=1.0, duration_s=DURATION_S, **SHAPES)
    sustained = await capacity(proc.base, MODEL, shape, concurrency=LIMIT, duration_s=12.0)
    rate = max(OVERLOAD * sustained, MIN_RATE_PER_S)
    mix = Mix(rate_per_s=rate, duration_s=DURATION_S, timeout_s=60.0, **SHAPES)

    stop = asyncio.Event()
    rss_task = asyncio.create_task(_sample_rss(proc.popen.pid, stop))
    outcomes = await run_mix(proc.base, MODEL, mix)
    stop.set()
    rss = await rss_task
    summary = summarize(outcomes, {INTERACTIVE: slo, BATCH: BATCH_DEADLINE_S + 30.0}, DURATION_S)
    metrics = await _metrics(proc)
    quarter = max(1, len(rss) // 4)
    early, late = statistics.median(rss[quarter : 2 * quarter]), statistics.median(rss[-quarter:])
    print(
        f"\nunloaded TTFT {1000 * base_ttft:.1f} ms -> interactive SLO {1000 * slo:.0f} ms; "
        f"sustained {sustained:.2f} req/s -> offered {mix.rate_per_s:.2f} req/s for {DURATION_S:.0f} s\n"
        f"{json.dumps(summary, indent=1)}\n"
        f"daemon RSS MiB: 2nd quarter {early:.0f}, last quarter {late:.0f} (samples {len(rss)})"
    )
    inter, batch = summary[INTERACTIVE], summary[BATCH]
    # Poisson arrivals: at least 60 interactive and 140 batch expected; these bounds are 4 sigma below
    assert inter["sent"] > 30 and batch["sent"] > 90, (inter["sent"], batch["sent"])
    # The target, >= 99% of interactive requests within the SLO, is printed above, not asserted
    # (a latency on a shared machine). Measured 100% in every run with a poll sleep, 18-96% with vLLM's
    # spin (docs/benchmarks.md, section 7). What the gate decides is asserted: the least urgent class
    # sheds first, the most urgent is served most.
    inter_refused, batch_refused = (c["refused_429"] / c["sent"] for c in (inter, batch))
    assert inter_refused < batch_refused, (inter_refused, batch_refused)
    assert inter["served"] / inter["sent"] > batch["served"] / batch["sent"]
    assert batch["refused_429"] > 0.3 * batch["sent"], "about 3x capacity: most of the excess is refused"
    refused = inter["refused_429"] + batch["refused_429"]
    # every 429 is an answer with Retry-After: a stream waits for its slot before its 200, so one
    # whose deadline passes is refused like any request, not with an error event after a 200
    for c in (inter, batch):
        assert c["refused_429"] == c["refused_with_retry_after"] and c["refused_in_stream"] == 0, c
    for cls in (inter, batch):
        assert cls["server_errors_5xx"] == 0 and cls["no_answer"] == 0 and cls["other"] == 0, cls
    # Nobody waited in the gate past its class's deadline (the deadlines are bucket bounds).
    for name, deadline in ((INTERACTIVE, INTERACTIVE_DEADLINE_S), (BATCH, BATCH_DEADLINE_S)):
        count = metrics.get(f'autopilot_queue_wait_seconds_count{{priority_class="{name}"}}', 0.0)
        within = metrics.get(
            f'autopilot_queue_wait_seconds_bucket{{le="{deadline}",priority_class="{name}"}}'
        )
        assert within == count, (name, within, count)
    # Every refusal is counted under its class, none under "unknown".
    counted = sum(v for k, v in metrics.items() if k.startswith("autopilot_rejected_requests_total"))
    timeouts = sum(v for k, v in metrics.items() if k.startswith("autopilot_queue_timeouts_total"))
    assert counted + timeouts >= refused
    assert not any('priority_class="unknown"' in k for k in metrics)
    assert late <= early + max(48.0, 0.05 * early), (early, late)


async def test_disconnect_while_queued_leaves_the_queue(daemon_proc: Proc) -> None:
    proc = daemon_proc
    long = {"model": MODEL, "prompt": "x", "max_tokens": 600, "ignore_eos": True, "stream": True}
    long["priority"] = 5
    # Start from a quiet gate: with the tail of an earlier test's completions in its 10 s window the
    # measured rate is tiny, the expected wait of the 4 queued requests passes batch's deadline and
    # they are refused early (429) instead of queued, and the test would measure the refusal path.
    t0 = time.monotonic()
    while (gate := (await _state(proc))["gate"])["in_flight"] or gate["completion_rate_per_s"] is not None:
        assert time.monotonic() - t0 < 60, gate
        await asyncio.sleep(0.5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        holders = [await s.post(proc.base + "/v1/completions", json=long) for _ in range(LIMIT - RESERVED)]
        # a stream's 200 goes out once it has its slot: these wait for one without an answer
        queued = [asyncio.create_task(s.post(proc.base + "/v1/completions", json=long)) for _ in range(4)]
        t0 = time.monotonic()
        while (await _state(proc))["gate"]["queue_depth_by_class"]["batch"] < 4:
            statuses = [r.status for r in holders]
            assert time.monotonic() - t0 < 10, (statuses, (await _state(proc))["gate"])
            await asyncio.sleep(0.1)
        assert not any(t.done() for t in queued), "a queued stream was answered before its slot"
        for task in queued:
            task.cancel()  # the clients go away while their requests wait for a slot
        await asyncio.gather(*queued, return_exceptions=True)
        t0 = time.monotonic()
        while (await _state(proc))["gate"]["queue_depth"] > 0:
            assert time.monotonic() - t0 < 5, "cancelled requests still queued"
            await asyncio.sleep(0.1)
        state = await _state(proc)
        assert state["gate"]["in_flight"] == LIMIT - RESERVED  # the running ones are untouched
        for resp in holders:
            resp.close()  # disconnect while running: aborted in the engine, slots come back
        t0 = time.monotonic()
        while (await _state(proc))["gate"]["in_flight"] > 0:
            assert time.monotonic() - t0 < 10, "aborted requests still hold slots"
            await asyncio.sleep(0.1)


async def test_bad_requests_keep_vllms_own_4xx(daemon_proc: Proc) -> None:
    proc = daemon_proc
    too_long = {"model": MODEL, "prompt": "the " * 3000, "max_tokens": 8}
    async with http_session() as s:
        for _ in range(3 * LIMIT):  # more than the gate could hold as pending if they leaked
            async with s.post(proc.base + "/v1/completions", json=too_long) as r:
                assert r.status == 400, await r.text()
        headers = {"Content-Type": "application/json"}
        async with s.post(proc.base + "/v1/completions", data=b"{not json", headers=headers) as r:
            assert 400 <= r.status < 500
        bad = {"model": MODEL, "prompt": "x", "max_tokens": -1}
        async with s.post(proc.base + "/v1/completions", json=bad) as r:
            assert 400 <= r.status < 500
    state = await _state(proc)
    assert state["gate"]["pending"] == 0, "admitted-then-refused requests gave their place back"
