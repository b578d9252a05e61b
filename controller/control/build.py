"""The policy and the normalize stage that the config tables describe, built the same way by the
daemon (``controller/lifecycle/parts.py``) and the twin (``controller/sim/twin.py``). No vLLM here:
the twin runs without it."""

from __future__ import annotations

from controller.config.load import Config, ControlConfig
from controller.control.normalize import Normalizer
from policies.base import Policy, build_policy


def policy_for(config: Config) -> Policy:
    """``[control] policy`` and its params, started at ``[admission] limit``."""
    return build_policy(
        config.control.policy,
        config.control.params,
        max_num_seqs=config.max_num_seqs,
        initial_limit=config.admission.limit,
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
