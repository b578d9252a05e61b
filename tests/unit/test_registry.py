"""policies/base.py: every built-in policy is found by name and built with its defaults."""

from __future__ import annotations

import pytest

from policies.base import REGISTRY, Decision, Policy, build_policy, resolve
from tests.helpers import obs

BUILT_INS = ["hysteresis", "pid", "slo", "static"]


@pytest.mark.parametrize("name", BUILT_INS)
def test_built_in_policies_resolve_and_run_with_defaults(name: str) -> None:
    cls = resolve(name)
    assert REGISTRY[name] is cls
    policy = build_policy(name, {}, max_num_seqs=64, initial_limit=64)
    assert isinstance(policy, Policy)
    decision = policy.decide(obs(now_mono=1.0), 1.0)
    assert isinstance(decision, Decision) and decision.reason
    assert all(isinstance(v, float) for v in policy.terms().values())
    assert isinstance(policy.params(), dict)


@pytest.mark.parametrize("name", ["hysteresis", "pid", "slo"])
def test_stale_stats_hold_every_policy(name: str) -> None:
    policy = build_policy(name, {}, max_num_seqs=64, initial_limit=64)
    assert policy.decide(obs(in_flight=3, stats_age_s=30.0), 0.0) == Decision(None, None, "stale_stats")
