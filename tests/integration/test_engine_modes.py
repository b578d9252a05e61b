"""The batch cap and the token budget in vLLM's other engine modes, on the tiny model on the CPU:
async scheduling (the EngineCore's batch queue schedules the next step while the current one runs,
with our ``CappedAsyncScheduler``) and data parallelism (two EngineCores behind one load-balancing
client, the cap and the budget applied to each). One daemon per mode, one mode at a time.

The control loop sets the knobs: the static policy holds the cap at ``CAP`` and the budget at
``BUDGET`` (the budget moves at most a halving per tick, so the test ticks the loop until both are
in force); after that the loop ticks only when told, so the test alone drains the engine's steps.

vLLM's CPU platform turns async scheduling off whatever the config asks ("not required on CPU", in
``CpuPlatform.check_and_update_config``); the async daemon lifts that veto in this process, so its
engine runs vLLM's async EngineCore loop as it does on a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from controller.control.steps import EngineStep, StepCost, costs
from controller.engine.runtime.scheduler import scheduler_path
from controller.lifecycle.daemon import Daemon
from tests.helpers import admin_url, http_session, running_daemon, stream_completion, url, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CAP, BUDGET = 2, 64
STREAMS, TOKENS = 12, 48
LONG_PROMPT = " ".join(["engine"] * 600)


def _config(folder: Path, **engine: Any) -> Path:
    return write_config(
        folder / "config.toml",
        # prefix caching off: every prompt is prefilled whole, so a step's tokens are the prompt's
        engine={"max_num_batched_tokens": 2048, "enable_prefix_caching": False, **engine},
        control={
            "tick_s": 3600.0,
            "policy": "static",
            "params": {"max_num_active_seqs": CAP, "max_num_scheduled_tokens": BUDGET},
        },
    )


@contextlib.contextmanager
def cpu_async_scheduling() -> Iterator[None]:
    """vLLM's CPU platform hook without its veto: a config that asks for async scheduling keeps it."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.check_and_update_config

    def lifted(cls: type, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        original(vllm_config)
        if wanted:
            vllm_config.scheduler_config.async_scheduling = True

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(platform, "check_and_update_config", classmethod(lifted))
        yield


@contextlib.asynccontextmanager
async def knobs_daemon(config: Path) -> AsyncIterator[Daemon]:
    """The daemon on ``config``, once the loop has put the static policy's cap and budget in force
    (from 2048 the budget halves per tick: five ticks)."""
    async with running_daemon(config) as d:
        for _ in range(10):
            if (d.parts.host.batch_cap, d.parts.host.token_budget) == (CAP, BUDGET):
                break
            await d.parts.loop.tick()
        assert (d.parts.host.batch_cap, d.parts.host.token_budget) == (CAP, BUDGET)
        yield d


async def served_steps(d: Daemon, s: aiohttp.ClientSession) -> list[StepCost]:
    """The engine's steps while ``STREAMS`` streams of ``TOKENS`` tokens are served (all of them)."""
    return [c for _, c in costs(await served_records(d, s))]


async def served_records(d: Daemon, s: aiohttp.ClientSession) -> list[EngineStep]:
    """``served_steps`` as the engine host drained them, each with the engine that took it."""
    await d.parts.host.drain_steps()  # what the start left
    results = await asyncio.gather(*(stream_completion(s, url(d, ""), TOKENS) for _ in range(STREAMS)))
    assert all(r["status"] == 200 and r["tokens"] == TOKENS for r in results), results
    return await d.parts.host.drain_steps()


@contextlib.asynccontextmanager
async def decoding_stream(s: aiohttp.ClientSession, d: Daemon) -> AsyncIterator[None]:
    """A long stream, from its first token on (its prompt is prefilled: it decodes), read to the
    end in the background so the server never waits on this client."""
    body = {"model": "tiny", "prompt": "a stream to decode beside", "max_tokens": 1500, "ignore_eos": True}
    async with s.post(url(d, "/v1/completions"), json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                break
        reader = asyncio.create_task(resp.read())
        try:
            yield
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def prefill_beside_streams(
    d: Daemon, s: aiohttp.ClientSession, streams: int
) -> tuple[int, list[StepCost]]:
    """A long prompt's tokens and the engine's steps while it is served beside a decoding stream:
    ``streams`` of them first (one per engine, as the load-balancing client spreads them), and one
    more for each try whose prompt landed on an engine with none (the balancer reads the engines'
    counts as they last reported them, so two streams sent at once can share an engine). Each try
    opens its streams afresh, and a try counts only where every chunk of the prompt shared its step
    with a decode: a stream can end in the middle of the prompt's prefill (make test and CI saw
    chunks of 63, 63, 63 and then the rest, 411, alone, in a step with nothing to decode)."""
    for attempt in range(4):
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(streams + attempt):
                await stack.enter_async_context(decoding_stream(s, d))
            await d.parts.host.drain_steps()
            body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 3, "ignore_eos": True}
            async with s.post(url(d, "/v1/completions"), json=body) as r:
                assert r.status == 200, await r.text()
                tokens = int((await r.json())["usage"]["prompt_tokens"])
            steps = [c for _, c in costs(await d.parts.host.drain_steps())]
        if all(st.decode_seqs for st in steps if st.prefill_tokens):
            break  # each of its chunks shared a step with a stream: beside one throughout
    return tokens, steps


async def generated_by_engine(d: Daemon, s: aiohttp.ClientSession) -> dict[str, float]:
    """vLLM's generated-token counter of each engine, by its ``engine`` label, from /metrics."""
    async with s.get(admin_url(d, "/metrics")) as r:
        text = await r.text()
    pattern = r'^vllm:generation_tokens_total\{engine="(\d+)",[^}]*\} ([0-9.e+]+)$'
    return {engine: float(value) for engine, value in re.findall(pattern, text, re.M)}


def assert_budget_held(tokens: int, steps: list[StepCost]) -> None:
    """Every step that decoded stayed within the budget, and the prompt came in chunks that add up."""
    assert all(st.prefill_tokens + st.decode_seqs <= BUDGET for st in steps if st.decode_seqs), steps
    prefills = [st.prefill_tokens for st in steps if st.prefill_tokens]
    assert sum(prefills) == tokens and 300 < tokens < 2048
    assert len(prefills) >= math.ceil(tokens / (BUDGET - 1)), prefills  # 1 of each step for the decode


# -- async scheduling -------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="class", loop_scope="module")
async def async_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    config = _config(tmp_path_factory.mktemp("async"), async_scheduling=True)
    with cpu_async_scheduling():
        async with knobs_daemon(config) as d:
            yield d


class TestAsyncScheduling:
    async def test_the_engine_runs_the_capped_async_scheduler(self, async_daemon: Daemon) -> None:
        scheduling = async_daemon.parts.host.llm.vllm_config.scheduler_config
        assert scheduling.async_scheduling is True
        assert scheduling.scheduler_cls == scheduler_path(True)

    async def test_the_cap_bounds_the_sequences_of_every_step(self, async_daemon: Daemon) -> None:
        t0 = time.monotonic()
        async with http_session() as s:
            steps = await served_steps(async_daemon, s)
        assert max(st.decode_seqs for st in steps) == CAP
        assert async_daemon.parts.window.max_running_since(t0) == CAP
        # each stream's first token comes with its prefill, each other token with one decode (the
        # async scheduler schedules no step past max_tokens), and every step's figures came back
        assert sum(st.decode_seqs for st in steps) == STREAMS * (TOKENS - 1)

    async def test_the_budget_holds_beside_a_decoding_stream(self, async_daemon: Daemon) -> None:
        async with http_session() as s:
            assert_budget_held(*await prefill_beside_streams(async_daemon, s, 1))


# -- data parallelism -------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="class", loop_scope="module")
async def dp_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    config = _config(tmp_path_factory.mktemp("dp"), data_parallel_size=2)
    async with knobs_daemon(config) as d:
        yield d


class TestDataParallel:
    async def test_the_cap_bounds_each_engines_steps_and_every_step_is_counted(
        self, dp_daemon: Daemon
    ) -> None:
        t0 = time.monotonic()
        async with http_session() as s:
            before = await generated_by_engine(dp_daemon, s)
            records = await served_records(dp_daemon, s)
            after = await generated_by_engine(dp_daemon, s)
        steps = [c for _, c in costs(records)]
        assert sorted(after) == ["0", "1"] and all(after[e] > before.get(e, 0.0) for e in after), after
        # both engines' steps (a drain of the first engine alone would count about half the decodes)
        assert sum(st.decode_seqs for st in steps) == STREAMS * (TOKENS - 1)
        assert max(st.decode_seqs for st in steps) == CAP  # each engine, not only the first
        # each step names the engine that took it as vLLM's counters name it: an engine's decodes are
        # its streams' tokens but their first (each stream's TOKENS, counted by its `engine` label)
        for e in after:
            decodes = sum(r.cost.decode_seqs for r in records if r.engine_idx == int(e) and r.cost)
            generated = after[e] - before.get(e, 0.0)
            assert decodes == generated * (TOKENS - 1) / TOKENS, (e, decodes, generated)
        assert dp_daemon.parts.window.max_running_since(t0) == CAP  # each engine reports its own
        assert await dp_daemon.parts.actuator.set_batch_cap(1000) == 16  # max_num_seqs is per engine
        await dp_daemon.parts.actuator.set_batch_cap(CAP)

    async def test_the_budget_holds_on_each_engine(self, dp_daemon: Daemon) -> None:
        async with http_session() as s:
            assert_budget_held(*await prefill_beside_streams(dp_daemon, s, 2))
