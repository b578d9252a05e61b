"""The slo loop on the real model: with config.toml as shipped (SmolLM2, the slo policy, its [slo] of
TTFT 5 s and TPOT 250 ms, the step-cost fit seeded by the warm-up at startup), decoding streams
and a long prompt make the loop size the token budget and the batch cap to the TPOT bound, with the
figures in each reason, and move them inside the running engine.

On this model a prefill token costs milliseconds on the CPU, so vLLM's default budget of 2048 tokens
lets one prompt stall every stream for seconds: the budget binds, and the loop must cut it to the
chunk that fits a step within the bound beside the decodes, and the cap to the batch whose decode
step leaves room for a few prefill tokens. How large that chunk is depends on the CPU: about 20
tokens on an AVX2 box (6.7 ms a prefill token), about 150 on one with AVX-512 (1.2 ms); either way it
is well below the long prompt, which is then prefilled in chunks. Figures only, no timing asserted:
the loop's reasons carry the predicted steps.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, shipped_config, stream_completion, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

STREAMS, TOKENS = 4, 96
MODEL = "smollm2"
LONG = 300
"""The long prompt's tokens: on any CPU where a prefill token costs a millisecond or more its one
step would miss the 225 ms the budget is planned to, so the budget must come below it."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_model: Path) -> AsyncIterator[Daemon]:
    shipped = shipped_config()
    assert shipped["control"]["policy"] == "slo" and "cost_profile" not in shipped["control"]
    path = write_config(
        tmp_path_factory.mktemp("steer") / "config.toml",
        # float32 on every box (config.toml's dtype resolves to bf16 on a CPU with native bf16): the
        # chunk sizes above are float32's; in bf16 a prefill token costs less and the chunk nears LONG
        engine={**shipped["engine"], "model": str(smollm2_model), "dtype": "float32"},
        admission=shipped["admission"],
        slo=shipped["slo"],
        control=shipped["control"],  # no cost_profile: the fit starts from the warm-up
    )
    async with running_daemon(path) as d:
        yield d


async def test_the_loop_sizes_budget_and_cap_to_the_tpot_bound(daemon: Daemon) -> None:
    host = daemon.parts.host
    ceiling = host.max_num_batched_tokens
    assert host.token_budget == ceiling  # vLLM's budget until the loop moves it
    base = f"http://{daemon.config.server.host}:{daemon.config.server.port}"
    seen: list[tuple[int, int]] = []

    async def watch() -> None:
        while True:
            seen.append((host.token_budget, host.batch_cap))
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    async with http_session() as s:
        streams = [
            stream_completion(s, base, TOKENS, prompt="Tell me about the sea.", model=MODEL)
            for _ in range(STREAMS)
        ]

        async def long_prompt() -> dict[str, object]:
            await asyncio.sleep(8.0)  # the streams decode by now, and the loop has ticked several times
            return await stream_completion(s, base, 4, prompt=" ".join(["engine"] * LONG), model=MODEL)

        results = await asyncio.gather(*streams, long_prompt())
    watcher.cancel()
    assert all(r["status"] == 200 for r in results), results
    assert [r["tokens"] for r in results] == [TOKENS] * STREAMS + [4]

    budgets = [b for b, _ in seen]
    caps = [c for _, c in seen]
    # the budget falls from vLLM's 2048 to a chunk that fits the bound beside the decodes (its size
    # is the fit's: see the docstring), below the long prompt, and stays above the batch it serves
    assert min(budgets) < LONG < ceiling, budgets
    assert min(caps) < host.max_num_seqs, caps
    moves = [c for c in daemon.parts.loop.recent() if c["knob"] == "token_budget"]
    assert moves and STREAMS < moves[-1]["new"] < LONG, moves
    reason = moves[-1]["reason"]
    match = re.search(r"budget (\d+): step (\d+) ms at (\d+) decodes, bound 225 ms", reason)
    assert match, reason
    assert int(match[2]) <= 225 + 10  # planned to the bound (rounded to a token of prefill)
    assert re.search(r"cap \d+: (decode step with \d+ prefill tokens \d+ ms <= 225 ms|KV)", reason), reason
    cost = daemon.parts.cost.current()
    assert cost.ready and cost.seed.startswith(("warm-up: ", "state file ")) and cost.samples > 50
