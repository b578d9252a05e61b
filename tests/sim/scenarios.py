"""Shared pieces of the twin's tests: a small KV-bound profile and load shapes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from controller.config.load import AdmissionConfig, ControlConfig
from controller.load.workload import RequestSpec, poisson
from controller.profiles.load import EngineLimits, Profile
from controller.sim.run import SimResult
from controller.sim.twin import build_simulation
from policies.cost import StepCoefficients

COST = StepCoefficients(a_s=0.005, b_s_per_prefill_token=2e-5, c_s_per_decode_seq=1e-4, d_s_per_kv_token=1e-7)
LIMITS = EngineLimits(
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    block_size=16,
    kv_cache_tokens=16384,
    max_model_len=4096,
    scheduling_policy="fcfs",
)
PROFILE = Profile(name="test-kv-bound", cost=COST, engine=LIMITS)
"""1024 KV blocks: about 40 requests of 200 + 200 tokens fit at once, 128 could run."""


def shape(
    rate: float, duration_s: float, seed: int, start_s: float = 0.0, first: int = 0
) -> list[RequestSpec]:
    """Poisson arrivals of 200-token prompts and 200-token outputs."""
    specs = poisson(rate, duration_s, prompt_tokens=200, output_tokens=200, seed=seed)
    return [replace(s, index=first + s.index, arrival_s=start_s + s.arrival_s) for s in specs]


def step_load(
    rate: float, before_s: float, after_s: float, factor: float = 2.0, seed: int = 1
) -> list[RequestSpec]:
    """``rate`` for ``before_s``, then ``factor * rate`` for ``after_s``."""
    low = shape(rate, before_s, seed)
    high = shape(rate * factor, after_s, seed + 1, start_s=before_s, first=len(low))
    return low + high


def simulate(
    specs: Sequence[RequestSpec],
    policy: str,
    params: dict[str, Any] | None = None,
    *,
    profile: Profile = PROFILE,
    normalizer: dict[str, Any] | None = None,
    admission: AdmissionConfig | None = None,
    seed: int = 0,
    jitter: float = 0.0,
    use_variance: bool = True,
) -> SimResult:
    """``specs`` through the twin under ``policy``; ``normalizer`` sets ``[control]``'s normalize keys
    (tolerance, max_step_up, ...), ``admission`` the gate (default: its limit at ``max_num_seqs``)."""
    control = ControlConfig(policy=policy, params=params or {}, **(normalizer or {}))
    sim = build_simulation(profile, control, admission, seed=seed, jitter=jitter, use_variance=use_variance)
    return asyncio.run(sim.run(specs))


def uniform(rate: float, duration_s: float, start_s: float = 0.0, first: int = 0) -> list[RequestSpec]:
    """Evenly spaced arrivals of 200 + 200-token requests: a load without noise, for settling tests."""
    n = round(rate * duration_s)
    return [RequestSpec(first + k, start_s + k / rate, 200, 200) for k in range(n)]


def uniform_step(rate: float, before_s: float, after_s: float, factor: float = 2.0) -> list[RequestSpec]:
    low = uniform(rate, before_s)
    return low + uniform(rate * factor, after_s, start_s=before_s, first=len(low))
