"""The static policy: fixed values, as an operator would set them by hand."""

from __future__ import annotations

from typing import Any

from policies.base import Decision, Observation, Policy
from policies.common import check_choice, check_int

PRESETS: dict[str, dict[str, int]] = {
    # The usual tuning advice: small batches for chat latency, large ones for batch throughput.
    "interactive": {"max_num_active_seqs": 32, "admission_limit": 32},
    "throughput": {"max_num_active_seqs": 256, "admission_limit": 512},
    "mixed": {"max_num_active_seqs": 128, "admission_limit": 128},
    "small": {"max_num_active_seqs": 48, "admission_limit": 48},
}


class StaticPolicy(Policy):
    """Holds the batch cap, the admission limit and (when given) the token budget at fixed values.

    Formula: batch cap ``B``, admission limit ``L``, token budget ``T`` at every tick.
    Parameters, named as vLLM names the two engine knobs: ``preset`` (one of PRESETS) or explicit
    ``max_num_active_seqs`` (``B``) / ``admission_limit`` (``L``) (explicit values override the
    preset's), and ``max_num_scheduled_tokens`` (``T``). Without any, ``B`` is the engine's
    ``max_num_seqs``, ``L`` is ``[admission] limit`` and the token budget is left as the engine has it
    (``max_num_batched_tokens``). The normalize stage clamps ``B`` to ``max_num_seqs`` and ``T`` to
    ``max_num_batched_tokens``.
    States: none.
    """

    name = "static"

    def __init__(
        self,
        *,
        max_num_seqs: int,
        initial_limit: int,
        preset: str | None = None,
        max_num_active_seqs: int | None = None,
        admission_limit: int | None = None,
        max_num_scheduled_tokens: int | None = None,
    ) -> None:
        base: dict[str, int] = {"max_num_active_seqs": max_num_seqs, "admission_limit": initial_limit}
        if preset is not None:
            base = dict(PRESETS[check_choice("preset", preset, tuple(PRESETS))])
        for key, value in (
            ("max_num_active_seqs", max_num_active_seqs),
            ("admission_limit", admission_limit),
            ("max_num_scheduled_tokens", max_num_scheduled_tokens),
        ):
            if value is not None:
                base[key] = check_int(key, value, 1)
        self.preset = preset
        self.batch_cap = base["max_num_active_seqs"]
        self.admission_limit = base["admission_limit"]
        self.token_budget = base.get("max_num_scheduled_tokens")

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        return Decision(self.admission_limit, self.batch_cap, "static", token_budget=self.token_budget)

    def params(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "max_num_active_seqs": self.batch_cap,
            "admission_limit": self.admission_limit,
            "max_num_scheduled_tokens": self.token_budget,
        }
