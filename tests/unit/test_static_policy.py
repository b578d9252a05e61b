"""policies/static.py and the policy registry in policies/base.py: tables of params and the exact
decisions they produce."""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import REGISTRY, Decision, Observation, Policy, PolicyError, build_policy, resolve
from policies.static import PRESETS, StaticPolicy
from tests.helpers import idle_obs

MAX_NUM_SEQS = 64
INITIAL_LIMIT = 100
PRESET_NAMES = "'interactive', 'throughput', 'mixed', 'small'"


def observation(**overrides: Any) -> Observation:
    """An unremarkable tick; ``overrides`` set the fields a case is about."""
    return idle_obs(
        **{
            "admission_limit": INITIAL_LIMIT,
            "batch_cap": MAX_NUM_SEQS,
            "max_num_seqs": MAX_NUM_SEQS,
            **overrides,
        }
    )


class EchoPolicy(Policy):
    """A plug-in for the "module:Class" lookup: holds what it was built with."""

    name = "echo"

    def __init__(self, *, max_num_seqs: int, initial_limit: int, step: int = 1) -> None:
        self.max_num_seqs = max_num_seqs
        self.initial_limit = initial_limit
        self.step = step

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        return Decision(obs.admission_limit + self.step, None, "echo")


class NotAPolicy:
    pass


def static(**params: Any) -> StaticPolicy:
    policy = build_policy("static", params, max_num_seqs=MAX_NUM_SEQS, initial_limit=INITIAL_LIMIT)
    assert isinstance(policy, StaticPolicy)
    return policy


@pytest.mark.parametrize(
    ("params", "batch_cap", "admission_limit"),
    [
        ({}, MAX_NUM_SEQS, INITIAL_LIMIT),  # no params: hold what the config says
        ({"preset": "interactive"}, 32, 32),
        ({"preset": "throughput"}, 256, 512),  # above max_num_seqs: the normalize stage clamps it
        ({"preset": "mixed"}, 128, 128),
        ({"preset": "small"}, 48, 48),
        ({"preset": "interactive", "max_num_active_seqs": 40}, 40, 32),
        ({"preset": "throughput", "admission_limit": 100}, 256, 100),
        ({"preset": "small", "max_num_active_seqs": 8, "admission_limit": 9}, 8, 9),
        ({"max_num_active_seqs": 16}, 16, INITIAL_LIMIT),
        ({"admission_limit": 1}, MAX_NUM_SEQS, 1),
    ],
)
def test_static_values(params: dict[str, Any], batch_cap: int, admission_limit: int) -> None:
    policy = static(**params)
    expected = Decision(admission_limit=admission_limit, batch_cap=batch_cap, reason="static")
    # the same decision whatever it observes: the static policy never reacts
    for obs in (
        observation(),
        observation(queued=500, kv_usage=1.0, preemptions_per_s=3.0, stats_age_s=60.0),
    ):
        assert policy.decide(obs, obs.now_mono) == expected
    assert policy.params() == {
        "preset": params.get("preset"),
        "max_num_active_seqs": batch_cap,
        "admission_limit": admission_limit,
        "max_num_scheduled_tokens": None,
    }
    assert policy.terms() == {}


def test_a_token_budget_is_held_too() -> None:
    policy = static(max_num_active_seqs=8, max_num_scheduled_tokens=512)
    assert policy.decide(observation(), 0.0) == Decision(INITIAL_LIMIT, 8, "static", token_budget=512)
    assert policy.params()["max_num_scheduled_tokens"] == 512


def test_presets_table() -> None:
    assert PRESETS == {
        "interactive": {"max_num_active_seqs": 32, "admission_limit": 32},
        "throughput": {"max_num_active_seqs": 256, "admission_limit": 512},
        "mixed": {"max_num_active_seqs": 128, "admission_limit": 128},
        "small": {"max_num_active_seqs": 48, "admission_limit": 48},
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"preset": "nope"}, f"preset = 'nope': must be one of {PRESET_NAMES}"),
        ({"preset": 5}, f"preset = 5: must be one of {PRESET_NAMES}"),
        ({"preset": ["small"]}, f"preset = ['small']: must be one of {PRESET_NAMES}"),
        ({"max_num_active_seqs": 0}, "max_num_active_seqs = 0: out of range; use a value >= 1"),
        ({"max_num_active_seqs": -4}, "max_num_active_seqs = -4: out of range; use a value >= 1"),
        ({"max_num_active_seqs": "32"}, "max_num_active_seqs = '32': must be int"),
        ({"max_num_active_seqs": True}, "max_num_active_seqs = True: must be int"),
        ({"admission_limit": 1.5}, "admission_limit = 1.5: must be int"),
        ({"max_num_scheduled_tokens": 0}, "max_num_scheduled_tokens = 0: out of range; use a value >= 1"),
        ({"preset": "small", "admission_limit": 0}, "admission_limit = 0: out of range; use a value >= 1"),
        (
            {"bogus": 1},
            "[control.params] for policy 'static': unknown parameter 'bogus': its parameters: "
            "admission_limit, max_num_active_seqs, max_num_scheduled_tokens, preset",
        ),
    ],
)
def test_invalid_params(params: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError) as exc:
        static(**params)
    assert str(exc.value) == message


def test_resolve_by_name() -> None:
    assert resolve("static") is StaticPolicy
    assert REGISTRY["static"] is StaticPolicy


def test_resolve_plug_in_by_module_and_class() -> None:
    name = "tests.unit.test_static_policy:EchoPolicy"
    assert resolve(name) is EchoPolicy
    assert "echo" not in REGISTRY  # a plug-in is not registered by being found
    policy = build_policy(name, {"step": 5}, max_num_seqs=8, initial_limit=3)
    assert isinstance(policy, EchoPolicy)
    assert (policy.max_num_seqs, policy.initial_limit, policy.step) == (8, 3, 5)
    assert policy.decide(observation(admission_limit=10), 1000.0) == Decision(15, None, "echo")


@pytest.mark.parametrize(
    ("name", "message_start"),
    [
        (
            "tests.unit.no_such_module:EchoPolicy",
            "policy 'tests.unit.no_such_module:EchoPolicy': cannot import it (No module named",
        ),
        (
            "tests.unit.test_static_policy:Missing",
            "policy 'tests.unit.test_static_policy:Missing': cannot import it (module",
        ),
        (
            "tests.unit.test_static_policy:NotAPolicy",
            "policy 'tests.unit.test_static_policy:NotAPolicy' is not a subclass of policies.base.Policy",
        ),
        (
            "tests.unit.test_static_policy:MAX_NUM_SEQS",
            "policy 'tests.unit.test_static_policy:MAX_NUM_SEQS' is not a subclass of policies.base.Policy",
        ),
    ],
)
def test_resolve_bad_plug_in(name: str, message_start: str) -> None:
    with pytest.raises(PolicyError) as exc:
        resolve(name)
    assert str(exc.value).startswith(message_start), str(exc.value)


def test_unknown_name_lists_the_registered_names() -> None:
    with pytest.raises(PolicyError) as exc:
        resolve("statik")
    assert str(exc.value) == (
        f"unknown policy 'statik': use one of {', '.join(sorted(REGISTRY))} or 'module:Class'"
    )
    assert "static" in REGISTRY
