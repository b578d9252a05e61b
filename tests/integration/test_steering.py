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
each tick's observation (the step-cost fit and the decodes it planned for) and the policy's terms
are recorded, and the step the budget plans is recomputed from them against the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from controller.control.loop import Change
from controller.lifecycle.daemon import Daemon
from policies.base import Observation
from policies.cost import CostEstimate
from policies.slo_policy import SloPolicy
from tests.helpers import (
    http_session,
    running_daemon,
    shipped_config,
    stream_completion,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

STREAMS, TOKENS = 4, 96
MODEL = "smollm2"
LONG = 300
"""The long prompt's tokens: on any CPU where a prefill token costs a millisecond or more its one
step would miss the bound the budget is planned to (``budget_margin`` of ``[slo] tpot_s``: 225 ms as
shipped), so the budget must come below it."""


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


@dataclass(frozen=True)
class Tick:
    """What one tick of the loop saw and planned."""

    running: int
    cost: CostEstimate | None
    terms: dict[str, float]
    changes: list[Change]


async def test_the_loop_sizes_budget_and_cap_to_the_tpot_bound(daemon: Daemon) -> None:
    host, loop = daemon.parts.host, daemon.parts.loop
    policy = loop.policy
    assert isinstance(policy, SloPolicy) and policy.slo is not None
    ceiling = host.max_num_batched_tokens
    # the seeded fit sizes the budget at the first tick, before any request (the slow start)
    assert host.token_budget <= ceiling
    base = f"http://{daemon.config.server.host}:{daemon.config.server.port}"
    ticks: list[Tick] = []

    def record(obs: Observation, changes: list[Change]) -> None:
        ticks.append(Tick(obs.running, obs.cost, policy.terms(), changes))

    def decoding_ticks() -> int:
        return sum(t.running > 0 for t in ticks)

    loop._subscribers.append(record)  # the test's own subscriber: every tick, as the loop saw it
    try:
        async with http_session() as s:
            streams = [
                stream_completion(s, base, TOKENS, prompt="Tell me about the sea.", model=MODEL)
                for _ in range(STREAMS)
            ]

            async def long_prompt() -> dict[str, object]:
                await wait_for(lambda: decoding_ticks() >= 3, 60.0, "three ticks with the streams decoding")
                return await stream_completion(s, base, 4, prompt=" ".join(["engine"] * LONG), model=MODEL)

            results = await asyncio.gather(*streams, long_prompt())
    finally:
        loop._subscribers.remove(record)
    assert all(r["status"] == 200 for r in results), results
    assert [r["tokens"] for r in results] == [TOKENS] * STREAMS + [4]

    moves = [(t, c) for t in ticks for c in t.changes]
    budgets = [c.new for _, c in moves if c.knob == "token_budget"]
    caps = [c.new for _, c in moves if c.knob == "batch_cap"]
    # the budget falls from vLLM's 2048 to a chunk that fits the bound beside the decodes (its size
    # is the fit's: see the docstring), below the long prompt, and stays above the batch it serves
    assert budgets and min(budgets) < LONG < ceiling, budgets
    # (the first tick, before any request, may already have set it: the seeded fit's slow start)
    assert min([*caps, host.batch_cap]) < host.max_num_seqs, caps
    tick, cut = [(t, c) for t, c in moves if c.knob == "token_budget" and t.running > 0][-1]
    assert STREAMS < cut.new < LONG, cut
    # planned to the bound: the step the fit predicts for this budget beside the decodes of its tick
    cost, d, k = tick.cost, tick.running, tick.terms["kv_tokens_per_seq"]
    assert cost is not None and cost.ready
    decode_s = cost.a_s + (cost.c_s_per_decode_seq + cost.d_s_per_kv_token * k) * d
    budget_bound_s = policy.budget_margin * policy.slo.tightest.tpot_s
    step_s = decode_s + cost.b_s_per_prefill_token * (tick.terms["budget"] - d)
    # a request's mean over its answer (vLLM's TPOT): the chunks' steps shared over a short answer
    answer, chunks = tick.terms["answer_tokens"], tick.terms["chunks_per_answer"]
    mean_s = step_s if answer <= 2 else (chunks * step_s + (answer - 1 - chunks) * decode_s) / (answer - 1)
    step_bound_s = policy.margin * policy.slo.tightest.tpot_s
    # or, where the chunk that fits is smaller, the budget's floor: room for the new cap's decodes
    # plus the prefill reserve (a budget below the batch starves its later decodes; the AMD box in
    # float32 planned a 4-token answer's chunk under the cap of its tick, and the floor held)
    reserve = policy._reserve(cost, step_bound_s)
    floor = max(d, min(int(tick.terms["cap"]), policy.max_num_seqs)) + reserve
    planned = mean_s <= budget_bound_s * (1 + 1e-9)
    assert planned or tick.terms["budget"] == floor, (step_s, mean_s, answer, chunks, floor)
    # and the cap to the batch whose decode step fits the step bound (or fewer, where the KV binds;
    # never below one sequence: a floor above it is the normalize stage's, [control] max_num_active_seqs_min)
    assert tick.terms["tau_s"] == pytest.approx(step_bound_s)
    cap = tick.terms["cap"]
    cap_step_s = cost.a_s + (cost.c_s_per_decode_seq + cost.d_s_per_kv_token * k) * cap
    assert cap == 1 or cap_step_s <= step_bound_s, (cap, cap_step_s)
    cost_now = daemon.parts.cost.current()
    assert cost_now.ready and cost_now.seed.startswith(("warm-up: ", "state file ")) and cost_now.samples > 50
