"""A fleet on this CPU: two daemons on the tiny model behind a real ``vllm-router`` process (the
``fleet`` extra's wheel), driven by ``bench run`` through the router.

Each daemon admits 2 requests and queues 1 (``[admission] limit = 2, max_queue = 1``, the static
policy holds them), so a third long stream sent to one daemon directly puts it at its limit: the
next request it gets is refused with 429 before it queues. What is checked is what docs/fleet.md
says of the router with ``--policy round_robin``:

* requests spread over both daemons (each daemon's gate counts its own in ``/state``);
* a 429 from the daemon at its limit is retried on the other one: every client gets 200; with both
  at their limit the client gets the last 429 and its ``Retry-After``;
* with ``--policy power_of_two`` the router reads each daemon's ``/get_load`` and sends requests to
  the one with the smaller load;
* a gateway's TTFT header (llm-d's ``x-llm-d-slo-ttft-ms``) sent through the router reaches each
  daemon's gate: a request its class would queue is refused once its own, tighter bound passes;
* one daemon's EngineCore killed under load: no request is lost beyond the streams that daemon's
  engine was producing when it died (each ends with a retryable error), and both serve again.

The router runs with the recipe's breaker threshold (``--cb-failure-threshold 3``, deploy/k8s): a
replica that answers 503 three times in a row gets no request until its breaker's timeout, here
shortened to 3 s (``--cb-timeout-duration-secs``; the recipe's is 10 s) so that the test's last check
finds the killed daemon back in the rotation within seconds. ``bench run`` scrapes the daemons'
metrics directly: a ``GET /metrics`` sent through the router lands on one worker, and its 200 counts
as a success for that worker's breaker, even while the worker's engine is dead (docs/fleet.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import pytest_asyncio

from controller.bench.router import routed
from controller.bench.router import router_binary as bench_router_binary
from controller.bench.servers import spawn, stop, wait_healthy
from controller.results.records import read_records
from tests.helpers import (
    ROOT,
    http_session,
    stream_completion,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ROUTER_VERSION = "0.1.17"
"""The release docs/fleet.md describes (the ``fleet`` extra's pin)."""
ROUTER_CACHE = Path.home() / ".cache" / "vllm-autopilot" / "router-venv"
"""Where the test installs the router when the project's environment lacks the ``fleet`` extra."""
LONG = 1800
"""max_tokens of a stream that holds a slot for the whole of a check (ignore_eos; max_model_len 2048)."""


# -- the router binary ------------------------------------------------------------------------------


def router_binary() -> Path:
    """``vllm-router`` from this interpreter's environment (``make test`` installs the ``fleet``
    extra), from PATH, or from the test's own cached environment, installed there on first use;
    the test skips, saying why, where none can be had."""
    with contextlib.suppress(FileNotFoundError):
        return bench_router_binary()
    cached = ROUTER_CACHE / "bin" / "vllm-router"
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    try:
        subprocess.run([sys.executable, "-m", "venv", str(ROUTER_CACHE)], check=True, capture_output=True)
        pip = [str(ROUTER_CACHE / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"vllm-router=={ROUTER_VERSION}"], check=True, capture_output=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        pytest.skip(
            f"vllm-router {ROUTER_VERSION} is not installed (pip install 'vllm-autopilot[fleet]') and "
            f"installing it into {ROUTER_CACHE} failed: {exc} {detail.decode(errors='replace')[-300:]}"
        )
    return cached


# -- two daemons and a router -------------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    url: str
    admin: str
    popen: subprocess.Popen[bytes]
    log: Path

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.admin + "/state", timeout=5) as r:
            return dict(json.load(r))

    def gate(self) -> dict[str, Any]:
        return dict(self.state()["gate"])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.admin + "/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def engine_core(self) -> psutil.Process:
        for child in psutil.Process(self.popen.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                    return child
        raise AssertionError(f"no EngineCore under daemon {self.name}")


@contextlib.contextmanager
def replicas(root: Path) -> Iterator[list[Replica]]:
    """Two daemons started together (their engines build side by side), yielded once both are healthy."""
    started: list[Replica] = []
    try:
        for name in ("a", "b"):
            folder = root / name
            folder.mkdir()
            config = write_config(
                folder / "config.toml",
                # one class, a deadline no check reaches: a full queue is the only refusal
                admission={
                    "limit": 2,
                    "max_queue": 1,
                    "classes": {"all": {"max_queue": 1, "queue_deadline_s": 600.0}},
                },
                guard={"max_restarts_per_hour": 5},
            )
            tables = config.read_text()
            server_port = _port_of(tables, "server")
            admin_port = _port_of(tables, "admin")
            command = [sys.executable, "-m", "controller", "serve", "--config", str(config)]
            log = folder / "daemon.log"
            popen = spawn(command, log, ROOT)
            url, admin = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{admin_port}"
            started.append(Replica(name, url, admin, popen, log))
        for r in started:
            wait_healthy(r.popen, [r.admin + "/healthz"], 240.0, r.log)
        yield started
    finally:
        for r in started:
            stop(r.popen, 0.0)  # no drain to wait for


def _port_of(toml_text: str, table: str) -> int:
    return int(tomllib.loads(toml_text)[table]["port"])


@contextlib.contextmanager
def router(binary: Path, workers: list[Replica], folder: Path, policy: str) -> Iterator[str]:
    """``vllm-router`` in front of ``workers`` with ``policy``; yields its URL once it answers. Its
    breaker stays open 3 s (the recipe's 10 s would outlast the checks after a kill)."""
    log = folder / f"router-{policy}.log"
    urls = [w.url for w in workers]
    with routed(urls, log, policy, binary=binary, breaker_open_s=3, request_timeout_s=180) as base:
        yield base


@dataclass
class Fleet:
    a: Replica
    b: Replica
    binary: Path
    folder: Path
    url: str
    """The round_robin router's URL."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Fleet]:
    binary = router_binary()
    folder = tmp_path_factory.mktemp("fleet")
    with replicas(folder) as (a, b), router(binary, [a, b], folder, "round_robin") as url:
        yield Fleet(a, b, binary, folder, url)


# -- the client side --------------------------------------------------------------------------------


async def bench_run(url: str, metrics: str, out: Path, *options: str) -> list[Any]:
    """``vllm-autopilot bench run`` through ``url``, scraping ``metrics``; the run's records."""
    argv = [sys.executable, "-m", "controller", "bench", "run", "--url", url, "--out", str(out)]
    argv += ["--metrics-url", metrics]
    argv += ["--model", "tiny", "--tokenizer", str(ROOT / "models" / "tiny"), "--warmup", "0"]
    argv += ["--request-timeout", "150", "--no-progress", *options]
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    assert proc.returncode == 0, stdout.decode()[-3000:]
    return read_records(out / "records.jsonl")


@contextlib.asynccontextmanager
async def at_limit(replica: Replica) -> AsyncIterator[None]:
    """``replica`` holding 2 long streams and queueing a third, sent to it directly: at its limit,
    it refuses the next request with 429. The streams are cut when the block ends."""
    async with holding(replica, 3):
        yield


@contextlib.asynccontextmanager
async def holding(replica: Replica, streams: int) -> AsyncIterator[None]:
    """``replica`` running ``streams`` long streams sent to it directly (2 take its slots, the rest
    queue), cut when the block ends."""
    expected = (min(streams, 2), max(0, streams - 2))
    async with http_session() as s:
        tasks = [asyncio.create_task(stream_completion(s, replica.url, LONG)) for _ in range(streams)]
        try:
            await wait_for(
                lambda: (replica.gate()["in_flight"], replica.gate()["queue_depth"]) == expected,
                30,
                f"daemon {replica.name} holding {expected}",
            )
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    await wait_for(lambda: replica.gate()["in_flight"] == 0, 30, f"daemon {replica.name} idle again")


async def post_status(s: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> int:
    async with s.post(base + "/v1/completions", json=body) as r:
        return r.status


def counts(r: Replica) -> tuple[int, int]:
    """Requests admitted, and refused (at admission, or in the queue once their deadline passed)."""
    g = r.gate()
    return int(g["admitted_total"]), int(g["rejected_total"]) + int(g["timed_out_total"])


# -- the checks -------------------------------------------------------------------------------------


async def test_requests_spread_over_both_daemons(fleet: Fleet, tmp_path: Path) -> None:
    before = {r.name: counts(r) for r in (fleet.a, fleet.b)}
    closed = "--workload closed --requests 12 --concurrency 2 --prompt-tokens 32 --output-tokens 16"
    records = await bench_run(fleet.url, fleet.b.url + "/metrics", tmp_path / "spread", *closed.split())
    assert [r.status for r in records] == ["ok"] * 12, [r.error for r in records]
    admitted = {r.name: counts(r)[0] - before[r.name][0] for r in (fleet.a, fleet.b)}
    assert admitted == {"a": 6, "b": 6}, admitted  # round robin: one each in turn
    print(f"round_robin: 12 requests through the router, admitted {admitted}")


async def test_a_429_at_one_daemon_is_retried_on_the_other(fleet: Fleet) -> None:
    async with at_limit(fleet.a):
        (a_admitted, a_rejected), (b_admitted, _) = counts(fleet.a), counts(fleet.b)
        async with http_session() as s:
            results = []
            for _ in range(2):  # 3 at a time: what the other daemon holds (2 in flight, 1 queued)
                results += await asyncio.gather(*(stream_completion(s, fleet.url, 16) for _ in range(3)))
        assert [r["status"] for r in results] == [200] * 6, results
        assert counts(fleet.a)[0] == a_admitted  # none of them ran on the daemon at its limit
        refused = counts(fleet.a)[1] - a_rejected
        assert refused >= 1  # round robin sent it some, and it refused each
        assert counts(fleet.b)[0] - b_admitted == 6
    print(f"one daemon at its limit: 6 of 6 answered 200, the full daemon refused {refused} attempts")


async def test_with_both_at_their_limit_the_client_gets_the_429_and_retry_after(fleet: Fleet) -> None:
    async with at_limit(fleet.a), at_limit(fleet.b), http_session() as s:
        start = time.monotonic()
        r = await stream_completion(s, fleet.url, 16)
        took = time.monotonic() - start
    headers = {k.lower(): v for k, v in r["headers"].items()}
    assert r["status"] == 429, r
    assert int(headers["retry-after"]) >= 1
    assert took < 5  # the router's own backoff (5 attempts), not the daemons' Retry-After
    print(f"both at their limit: 429 with Retry-After {headers['retry-after']} after {took:.2f} s")


async def test_a_ttft_header_through_the_router_reaches_the_gate(fleet: Fleet) -> None:
    """Both daemons' slots taken: a request without a header queues (its class waits 600 s); with
    llm-d's ``x-llm-d-slo-ttft-ms: 300`` each daemon refuses it once its own bound passes, the router
    tries the daemons in turn, and the last refusal reaches the client with its reason headers."""
    body = {"model": "tiny", "prompt": "the fleet serves", "max_tokens": 4}
    queued_before = sum(r.gate()["queue_depth"] for r in (fleet.a, fleet.b))
    async with holding(fleet.a, 2), holding(fleet.b, 2), http_session() as s:
        plain = asyncio.create_task(post_status(s, fleet.url, body))
        await wait_for(
            lambda: sum(r.gate()["queue_depth"] for r in (fleet.a, fleet.b)) == queued_before + 1,
            30,
            "the request without a header to queue",
        )
        plain.cancel()
        await asyncio.gather(plain, return_exceptions=True)
        refused_before = sum(counts(r)[1] for r in (fleet.a, fleet.b))
        start = time.monotonic()
        headers = {"x-llm-d-slo-ttft-ms": "300"}
        async with s.post(fleet.url + "/v1/completions", json=body, headers=headers) as r:
            status, answer, got = r.status, await r.json(), {k.lower(): v for k, v in r.headers.items()}
        took = time.monotonic() - start
    attempts = sum(counts(r)[1] for r in (fleet.a, fleet.b)) - refused_before
    assert status == 429, answer
    assert "own TTFT bound of 0.3s" in answer["error"]["message"], answer
    assert got["x-autopilot-refusal"] in ("deadline", "expected_wait")
    assert "x-llm-d-request-dropped-reason" in got and int(got["retry-after"]) >= 1
    assert 1 <= attempts <= 5 and took < 10
    reason = got["x-autopilot-refusal"]
    print(f"TTFT header through the router: 429 ({reason}) after {attempts} tries in {took:.2f} s")


def get_load_polls(replica: Replica) -> list[str]:
    """The router's ``/get_load`` requests in ``replica``'s log (vLLM's access log)."""
    return [line for line in replica.log.read_text(errors="replace").splitlines() if "/get_load" in line]


async def test_power_of_two_reads_get_load_and_avoids_the_loaded_daemon(fleet: Fleet) -> None:
    with router(fleet.binary, [fleet.a, fleet.b], fleet.folder, "power_of_two") as url:
        async with at_limit(fleet.a):
            polled = len(get_load_polls(fleet.a))  # two more polls (every 1 s) have seen the load
            await wait_for(lambda: len(get_load_polls(fleet.a)) >= polled + 2, 30, "two /get_load polls")
            (a_admitted, a_rejected), (b_admitted, _) = counts(fleet.a), counts(fleet.b)
            async with http_session() as s:
                results = [await stream_completion(s, url, 8) for _ in range(6)]
            assert [r["status"] for r in results] == [200] * 6, results
            assert counts(fleet.a) == (a_admitted, a_rejected)  # load 3 against 0: never chosen
            assert counts(fleet.b)[0] - b_admitted == 6
    polls = get_load_polls(fleet.a)
    assert polls and all(" 200" in line for line in polls), polls[-3:]


async def test_an_engine_core_killed_loses_only_its_streams_and_both_serve_again(
    fleet: Fleet, tmp_path: Path
) -> None:
    a_generation = fleet.a.state()["engine"]["generation"]
    # 3 at once: all three fit the other daemon (2 in flight, 1 queued) while this one recovers
    closed = "--workload closed --requests 24 --concurrency 3 --prompt-tokens 32 --output-tokens 64"
    run = asyncio.create_task(
        bench_run(fleet.url, fleet.b.url + "/metrics", tmp_path / "kill", *closed.split())
    )
    await wait_for(lambda: fleet.a.gate()["in_flight"] >= 1, 60, "load on daemon a")
    streaming = fleet.a.gate()["in_flight"]
    fleet.a.engine_core().send_signal(signal.SIGKILL)
    records = await run
    lost = [r for r in records if r.status != "ok"]
    # A request the dead engine had not started waits for the next engine; one refused with 503
    # during the recovery is retried by the router on the other daemon (and after three refusals the
    # breaker takes the recovering daemon out); a stream that had produced tokens ends with the
    # daemon's error, at most one per slot the daemon held (its limit, 2): retryable where it ran
    # beside others, or, where it ran alone, one that names the death and invites no retry (it may
    # be what killed the engine: the third review's finding 1)
    assert len(lost) <= 2, [(r.http_status, r.error) for r in lost]
    said = ("retry", "not run again")
    ended = [r.http_status == 200 and any(w in str(r.error) for w in said) for r in lost]
    assert all(ended), [r.error for r in lost]

    await wait_for(fleet.a.healthy, 120, "daemon a serving again")
    assert fleet.a.state()["engine"]["generation"] == a_generation + 1
    await asyncio.sleep(4)  # the router's breaker, if the recovery's 503s opened it, closes (3 s)
    before = {r.name: counts(r)[0] for r in (fleet.a, fleet.b)}
    async with http_session() as s:
        after_kill = [await stream_completion(s, fleet.url, 8) for _ in range(4)]
    assert [r["status"] for r in after_kill] == [200] * 4, after_kill
    served = {r.name: counts(r)[0] - before[r.name] for r in (fleet.a, fleet.b)}
    assert served["a"] >= 1 and served["b"] >= 1, served
    print(f"EngineCore of a killed with {streaming} in its engine: {len(lost)} of 24 lost; then {served}")
