"""The token budget moves inside the running engine, and the engine's per-step figures come out of it
(the tiny model on the CPU, one daemon for the module).

A prompt of P tokens is prefilled in one step under a budget above P, and under a budget of 64 too
when nothing else runs (a step of prefill alone stalls no stream); beside a decoding stream it is
prefilled in ceil(P / 63) chunks of at most 63 tokens (64 less the stream's decode). The prefill
tokens the EngineCore reports add up to P each time, and every step took a positive time. The control
loop ticks once at start, then only when told.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from controller.control.steps import StepCost, costs
from controller.lifecycle.daemon import Daemon
from tests.helpers import admin_url, http_session, running_daemon, url, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CEILING = 2048


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("cfg") / "config.toml",
        # prefix caching off: every prompt is prefilled whole, so a step's tokens are the prompt's
        engine={"max_num_batched_tokens": CEILING, "enable_prefix_caching": False},
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


async def complete(s: aiohttp.ClientSession, d: Daemon, prompt: str, max_tokens: int = 3) -> int:
    """One completion (short unless told); its prompt's length in tokens."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with s.post(url(d, "/v1/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        return int((await r.json())["usage"]["prompt_tokens"])


async def prefill_of(d: Daemon, s: aiohttp.ClientSession, prompt: str) -> tuple[int, list[StepCost]]:
    t0 = time.monotonic()
    await d.parts.host.drain_steps()  # what earlier requests left
    tokens = await complete(s, d, prompt)
    steps = costs(await d.parts.host.drain_steps())
    # t0 before the first drain: a stream decoding beside ends steps between the EngineCore's answer
    # to that drain and this coroutine resuming, and the second drain returns them.
    assert steps and all(t0 <= t <= time.monotonic() and st.step_s > 0 for t, st in steps), steps
    return tokens, [st for _, st in steps]


async def test_the_budget_moves_in_the_engine_and_chunks_a_long_prompt(daemon: Daemon) -> None:
    host, actuator = daemon.parts.host, daemon.parts.actuator
    assert (host.token_budget, host.max_num_batched_tokens, host.token_budget_min) == (CEILING, CEILING, 16)
    async with http_session() as s:
        tokens, whole = await prefill_of(daemon, s, " ".join(["engine"] * 600))
        assert 300 < tokens < CEILING
        assert [st.prefill_tokens for st in whole if st.prefill_tokens] == [tokens]
        assert any(st.decode_seqs == 1 for st in whole)  # the decodes that follow

        assert await actuator.set_token_budget(1) == 16  # the engine's own clamp, read back
        assert await actuator.set_token_budget(10**6) == CEILING
        assert await actuator.set_token_budget(64) == 64
        tokens, alone = await prefill_of(daemon, s, " ".join(["engine"] * 600))
        # nothing decodes beside it, so no stream stalls: the step takes the prompt whole
        assert [st.prefill_tokens for st in alone if st.prefill_tokens] == [tokens]

        generated = daemon.parts.window.total_generated_tokens
        stream = asyncio.create_task(complete(s, daemon, "a stream to decode beside", max_tokens=1500))
        await wait_for(  # its first token: its prefill is done, it decodes now
            lambda: daemon.parts.window.total_generated_tokens > generated, 30, "the stream to decode"
        )
        tokens, chunked = await prefill_of(daemon, s, " ".join(["engine"] * 600))
        stream.cancel()
        prefills = [st.prefill_tokens for st in chunked if st.prefill_tokens]
        assert len(prefills) == math.ceil(tokens / 63) and max(prefills) == 63, prefills  # 1 for the decode
        assert sum(prefills) == tokens

        async with s.get(admin_url(daemon, "/state")) as r:
            state = await r.json()
        assert state["token_budget"] == 64 and state["engine"]["token_budget"] == 64
        async with s.get(admin_url(daemon, "/metrics")) as r:
            assert "autopilot_max_num_scheduled_tokens 64.0" in await r.text()
    await actuator.set_token_budget(CEILING)
