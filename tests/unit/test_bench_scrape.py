"""Parsing vLLM's Prometheus page and our /state into time-series fields."""

from __future__ import annotations

from controller.bench.scrape import PreemptionCounter, parse_vllm, state_fields

PAGE = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 17.0
# HELP autopilot_engine_restarts_total Engine restarts by reason.
# TYPE autopilot_engine_restarts_total counter
autopilot_engine_restarts_total{reason="engine_died"} 1.0
autopilot_engine_restarts_total{reason="gpu_memory_low"} 2.0
"""


def test_parse_vllm_sums_label_sets_and_takes_the_max_kv() -> None:
    assert parse_vllm(PAGE) == {
        "kv_usage": 0.5, "running": 7.0, "waiting": 2.0, "preemptions": 17.0, "restarts": 3.0,
    }  # fmt: skip
    assert parse_vllm("") == {}


def test_preemptions_count_from_the_first_reading_across_resets() -> None:
    c = PreemptionCounter()
    assert [c.update(v) for v in (10.0, 12.0, 15.0, 2.0, 4.0)] == [0, 2, 5, 7, 9]  # reset after 15


def test_state_fields() -> None:
    state = {"admission_limit": 32, "batch_cap": 16, "token_budget": 96, "gate": {"queue_depth": 5}}
    assert state_fields(state) == {
        "admission_limit": 32,
        "batch_cap": 16,
        "token_budget": 96,
        "queue_depth": 5,
    }
    assert set(state_fields({}).values()) == {None}
