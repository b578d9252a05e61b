"""The static policy: fixed values, as an operator would set them by hand."""

from __future__ import annotations

from typing import Any

from policies.base import Decision, Observation, Policy, PolicyError

PRESETS: dict[str, dict[str, int]] = {
    # The usual tuning advice: small batches for chat latency, large ones for batch throughput.
    "interactive": {"batch_cap": 32, "admission_limit": 32},
    "throughput": {"batch_cap": 256, "admission_limit": 512},
    "mixed": {"batch_cap": 128, "admission_limit": 128},
    "small": {"batch_cap": 48, "admission_limit": 48},
}


class StaticPolicy(Policy):
    """Holds the batch cap, the admission limit and (when given) the token budget at fixed values.

    Formula: ``batch_cap = B``, ``admission_limit = L``, ``token_budget = T`` at every tick.
    Parameters: ``preset`` (one of PRESETS) or explicit ``batch_cap`` / ``admission_limit`` (explicit
    values override the preset's), and ``token_budget``. Without any, ``B`` is the engine's
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
        batch_cap: int | None = None,
        admission_limit: int | None = None,
        token_budget: int | None = None,
    ) -> None:
        base: dict[str, int] = {"batch_cap": max_num_seqs, "admission_limit": initial_limit}
        if preset is not None:
            if not isinstance(preset, str) or preset not in PRESETS:  # a TOML list is unhashable
                raise PolicyError(f"preset = {preset!r}: use one of {', '.join(PRESETS)}")
            base = dict(PRESETS[preset])
        for key, value in (
            ("batch_cap", batch_cap),
            ("admission_limit", admission_limit),
            ("token_budget", token_budget),
        ):
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise PolicyError(f"{key} = {value!r}: must be an integer >= 1")
                base[key] = value
        self.preset = preset
        self.batch_cap = base["batch_cap"]
        self.admission_limit = base["admission_limit"]
        self.token_budget = base.get("token_budget")

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        return Decision(self.admission_limit, self.batch_cap, "static", token_budget=self.token_budget)

    def params(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "batch_cap": self.batch_cap,
            "admission_limit": self.admission_limit,
            "token_budget": self.token_budget,
        }
