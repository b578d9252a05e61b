"""The twin's prefix cache follows vLLM's automatic prefix caching (vllm/v1/core/block_pool.py,
kv_cache_manager.py): full blocks only, the longest cached chain, never the last token, LRU eviction."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from controller.cli import main
from controller.config.load import ControlConfig
from controller.load.sessions import SharedPrefix, shared_prefix
from controller.profiles.load import EngineLimits, load_profile
from controller.sim.engine import SimEngine, SimRequest, StepPlan
from controller.sim.kvcache import BlockTable, KVCache
from controller.sim.twin import build_simulation
from policies.cost import StepCoefficients

COST = StepCoefficients(
    a_s=0.01, b_s_per_prefill_token=0.001, c_s_per_decode_seq=0.002, d_s_per_kv_token=1e-5
)


def engine(**limits: object) -> SimEngine:
    base = EngineLimits(
        max_num_seqs=8, max_num_batched_tokens=64, block_size=4, kv_cache_tokens=256, max_model_len=128
    )
    return SimEngine(dataclasses.replace(base, **limits), COST)  # type: ignore[arg-type]


def req(i: int, prompt: int, out: int, segments: tuple[tuple[int, int], ...] = ()) -> SimRequest:
    return SimRequest(i, prompt, out, 0, arrival_t=float(i), segments=segments)


def step(e: SimEngine, t: float) -> StepPlan:
    plan = e.plan()
    e.finish_step(plan, t)
    return plan


def served(e: SimEngine, r: SimRequest, t: float) -> StepPlan:
    """Add ``r`` to an idle engine and step until it finishes; the plan of its first step."""
    e.add(r)
    first = step(e, t)
    while e.has_work:
        t += 1.0
        step(e, t)
    return first


def test_a_second_request_with_the_same_three_block_prefix_prefills_only_its_suffix() -> None:
    e = engine()
    served(e, req(1, 17, 2, segments=((7, 12),)), 1.0)  # 12 shared tokens: 3 blocks of 4
    plan = served(e, req(2, 17, 2, segments=((7, 12),)), 10.0)
    second = plan.scheduled[0][0]
    assert [n for _, n in plan.scheduled] == [5]
    assert plan.prefill_tokens == 5 and plan.kv_tokens_read == 17  # attention still reads the 12
    assert second.num_cached_tokens == 12
    assert e.step_s(plan) == COST.step_s(5, 0, 17)


def test_a_request_sharing_its_whole_prompt_still_computes_the_last_block() -> None:
    e = engine()
    served(e, req(1, 12, 2, segments=((7, 12),)), 1.0)
    plan = served(e, req(2, 12, 2, segments=((7, 12),)), 10.0)
    # At most num_tokens - 1 = 11 tokens may hit: 2 whole blocks; the third (with the last token) is computed.
    assert plan.prefill_tokens == 4 and plan.scheduled[0][0].num_cached_tokens == 8


def test_a_prompt_shorter_than_a_block_caches_nothing() -> None:
    e = engine()
    served(e, req(1, 3, 1, segments=((7, 3),)), 1.0)
    assert e.kv.cached_blocks == 0
    plan = served(e, req(2, 3, 1, segments=((7, 3),)), 10.0)
    assert plan.prefill_tokens == 3 and plan.scheduled[0][0].num_cached_tokens == 0


def test_with_prefix_caching_off_every_prompt_token_is_computed() -> None:
    e = engine(enable_prefix_caching=False)
    served(e, req(1, 17, 2, segments=((7, 12),)), 1.0)
    plan = served(e, req(2, 17, 2, segments=((7, 12),)), 10.0)
    assert plan.prefill_tokens == 17 and plan.scheduled[0][0].num_cached_tokens == 0
    assert e.kv.cached_blocks == 0


def test_requests_without_shared_segments_never_hit_each_other() -> None:
    e = engine()
    served(e, req(1, 16, 1), 1.0)
    assert served(e, req(2, 16, 1), 10.0).prefill_tokens == 16


def test_freed_cached_blocks_are_evicted_least_recently_freed_first_and_only_when_needed() -> None:
    e = engine(kv_cache_tokens=32, max_model_len=32)  # 8 blocks of 4 tokens
    served(e, req(1, 8, 1, segments=((100, 8),)), 1.0)  # A: 2 blocks, freed tail first: A1, A0
    served(e, req(2, 8, 1, segments=((200, 8),)), 10.0)  # B: 2 uncached blocks, then B1, B0
    assert e.kv.cached_blocks == 4 and e.kv.free == 8  # cached and free alike
    served(e, req(3, 20, 1), 20.0)  # 5 blocks: the 4 uncached ones, then evicts A1 (freed first)
    assert e.kv.usage == 0.0
    b = served(e, req(4, 12, 1, segments=((200, 8),)), 30.0)
    assert b.prefill_tokens == 4  # both of B's blocks survived; its new block evicts A0, next in line
    a = served(e, req(5, 12, 1, segments=((100, 8),)), 40.0)
    assert a.prefill_tokens == 12  # nothing of A is left


def test_a_running_request_shares_its_cached_blocks_without_copying_them() -> None:
    e = engine()
    e.add(req(1, 12, 10, segments=((7, 12),)))
    step(e, 1.0)
    free = e.kv.free
    e.add(req(2, 16, 10, segments=((7, 12),)))
    plan = step(e, 2.0)
    assert dict((r.request_id, n) for r, n in plan.scheduled) == {1: 1, 2: 4}
    # Request 1 takes its 4th block (13 tokens); request 2 shares its first 3 and takes 1 more.
    assert free - e.kv.free == 2


def test_a_preempted_request_comes_back_from_its_own_cached_blocks() -> None:
    cache = KVCache(num_blocks=4, block_size=4)
    own = BlockTable(key=-1)
    assert cache.allocate(own, 0, 13, 13)
    cache.release(own)  # preempted: 3 full blocks stay cached
    hit = cache.lookup(own, 13)
    assert len(hit) == 3 and cache.allocate(own, 12, 1, 13, hit)
    assert cache.free == 0


def _ttft_p50(caching: bool) -> float:
    profile = load_profile("cpu-smollm2-avx512")
    engine_limits = dataclasses.replace(profile.engine, enable_prefix_caching=caching)
    static = ControlConfig(policy="static")  # vLLM's own scheduling, no gate: the engine's difference alone
    sim = build_simulation(dataclasses.replace(profile, engine=engine_limits), static, use_variance=False)
    specs = shared_prefix(0.5, 300.0, SharedPrefix(), seed=0)
    summary = asyncio.run(sim.run(specs)).summary(2.0, 0.1)
    assert summary["ok"] == len(specs)
    print(f"caching {caching}: TTFT p50 {summary['ttft_p50']:.3f} s, goodput {summary['goodput_rps']:.2f}")
    return float(summary["ttft_p50"])


def test_on_the_shared_prefix_workload_caching_halves_the_time_to_first_token() -> None:
    on, off = _ttft_p50(True), _ttft_p50(False)
    assert on < off / 2, (on, off)


def test_simulate_replays_the_shared_prefix_workload_with_caching_as_the_config_says(tmp_path: Path) -> None:
    off = tmp_path / "off.toml"
    off.write_text('[engine]\nmodel = "models/tiny"\nenable_prefix_caching = false\n')
    figures = {}
    for name, extra in (("on", []), ("off", ["--config", str(off)])):
        code = main([
            "simulate", "--workload", "shared-prefix", "--rate", "0.5", "--duration", "120",
            "--profile", "cpu-smollm2-avx512", "--policy", "static", "--no-variance", "--no-report",
            "--slo-ttft", "2", "--slo-tpot", "0.1", "--out", str(tmp_path / name), *extra,
        ])  # fmt: skip
        assert code == 0
        figures[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert figures["on"]["workload"] == figures["off"]["workload"]  # the same requests
    assert figures["on"]["load"].startswith("shared-prefix at 0.5 req/s")
    assert figures["on"]["ttft_p50"] < figures["off"]["ttft_p50"]


def test_simulate_takes_one_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--profile", "cpu-tiny", "--slo-ttft", "1", "--slo-tpot", "1", "--out", str(tmp_path)]
    assert main(args) == 1
    assert "--trace PATH or --workload shared-prefix" in capsys.readouterr().err
    assert main([*args, "--workload", "shared-prefix"]) == 1
    assert "needs --rate R" in capsys.readouterr().err


def test_the_first_two_requests_of_a_trace_share_nothing() -> None:
    e = engine()
    served(e, req(0, 16, 1), 1.0)
    assert served(e, req(1, 16, 1), 10.0).prefill_tokens == 16


def test_with_caching_a_preempted_request_recomputes_only_what_was_evicted() -> None:
    # As the FCFS preemption test: 16 blocks of 4, two requests of 28 prompt tokens decoding.
    e = engine(kv_cache_tokens=64, max_model_len=64)
    e.add(req(1, 28, 20))
    e.add(req(2, 28, 20))
    t = 1.0
    while not e.total_preemptions:
        step(e, t)
        t += 1
    victim = e.waiting.peek()
    assert victim.request_id == 2 and victim.blocks == 0
    known = victim.num_tokens
    scheduled: dict[int, int] = {}
    while 2 not in scheduled:
        scheduled = {r.request_id: n for r, n in step(e, t).scheduled}
        t += 1
    # Its first 4 blocks were still cached (request 1 took the tail ones, freed first): 16 tokens
    # read, 17 computed, where caching off recomputes all 33.
    assert (scheduled[2], known) == (17, 33)
    assert victim.num_computed_tokens == known
    assert victim.num_cached_tokens == 0  # vLLM's figure: the hit at its first scheduling
