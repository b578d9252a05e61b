"""Observations for policy and normalize tests: sensible defaults, override what the case is about."""

from __future__ import annotations

from typing import Any

from policies.base import Observation

DEFAULTS: dict[str, Any] = {
    "now_mono": 0.0,
    "admission_limit": 34,
    "batch_cap": 32,
    "max_num_seqs": 64,
    "in_flight": 20,
    "queued": 0,
    "running": 20,
    "kv_usage": 0.5,
    "kv_usage_mean": 0.5,
    "kv_usage_max": 0.5,
    "preemptions_per_s": 0.0,
    "generated_tokens_per_s": 1000.0,
    "ttft_p99_s": None,
    "itl_p99_s": None,
    "stats_age_s": 0.1,
}


def obs(**overrides: Any) -> Observation:
    """An Observation of a loaded, healthy engine (cap 32 of 64, KV half full), with ``overrides``."""
    unknown = set(overrides) - set(Observation.__dataclass_fields__)
    if unknown:
        raise TypeError(f"not Observation fields: {sorted(unknown)}")
    return Observation(**{**DEFAULTS, **overrides})


IDLE: dict[str, Any] = {
    **DEFAULTS,
    "now_mono": 1000.0,
    "in_flight": 0,
    "running": 0,
    "kv_usage": 0.0,
    "kv_usage_mean": 0.0,
    "kv_usage_max": 0.0,
    "generated_tokens_per_s": 0.0,
    "stats_age_s": None,
}


def idle_obs(**overrides: Any) -> Observation:
    """An Observation of an idle engine (nothing in flight, no stats yet), with ``overrides``."""
    return obs(**{**IDLE, **overrides})
