"""The policy and the normalize stage that the config tables describe, built the same way by the
daemon (``controller/lifecycle/parts.py``) and the twin (``controller/sim/twin.py``). No vLLM here:
the twin runs without it."""

from __future__ import annotations

from collections.abc import Sequence

from controller.admission.classes import PriorityClass
from controller.admission.ttft import NO_BOUNDS, PrefillEstimator, TtftBounds
from controller.config.load import Config, ControlConfig
from controller.control.normalize import Normalizer
from policies.base import Policy, build_policy
from policies.slo import SloTargets


def policy_for(config: Config) -> Policy:
    """``[control] policy`` and its params, started at ``[admission] limit``, with ``[slo]`` for a
    policy that steers to it."""
    return build_policy(
        config.control.policy,
        config.control.params,
        max_num_seqs=config.max_num_seqs,
        initial_limit=config.admission.limit,
        slo=config.slo,
    )


def normalizer_for(control: ControlConfig) -> Normalizer:
    """The normalize stage ``[control]`` describes."""
    return Normalizer(
        limit_max=control.limit_max,
        tolerance=control.tolerance,
        max_step_up=control.max_step_up,
        max_step_down=control.max_step_down,
        stabilization_s=control.stabilization_s,
    )


def ttft_for(
    policy: Policy, slo: SloTargets | None, classes: Sequence[PriorityClass], prefill: PrefillEstimator | None
) -> TtftBounds:
    """The gate's TTFT bounds (``admission/ttft.py``) under a policy that steers to ``[slo]``: each
    class's bound, and the step-cost model's prefill term; under any other policy (or without
    ``[slo]``) the queue deadlines alone govern, as configured."""
    if slo is None or not policy.takes_slo:
        return NO_BOUNDS
    share = float(getattr(policy, "ttft_wait_share", 1.0))  # of the bound, a queued request may wait
    return TtftBounds({c.name: slo.for_class(c.name).ttft_s for c in classes}, prefill, share)
