"""The warm-up's plan and fit, without the engine: the daemon runs the plan through vLLM
(``engine/runtime/warmup.py``, ``lifecycle/warm.py``), the twin through its engine model
(``sim/run.py``), and both fit the steps they measured the same way.

The phases excite each term of ``step = a + b*prefill + c*decode_seqs + d*kv_tokens`` apart: a prompt
alone (``b``), batches of short streams (``c``), and a few streams over long prompts (``d``), in order
of what they teach, so a budget that runs out drops the least informative. The plan runs once, on the
engine just built: a warm engine stepping back to back is faster than a served one, so repeating it
fits an intercept below the served steps' (the tiny model on a 2-core CPU: 1.73 ms on later passes,
2.04 ms on the first, 2.20 ms on the load after it; docs/results/warmup.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from controller.control.stepcost import CostPrior, FitSettings, StepCostModel
from controller.control.steps import EngineStep, costs
from policies.cost import StepCoefficients

PRIOR_SAMPLES = 20.0
"""The warm-up fit weighs as much as this many served steps."""


@dataclass(frozen=True)
class WarmupPhase:
    """``streams`` requests at once, each of ``prompt_tokens`` random tokens, generating ``output_tokens``."""

    streams: int
    prompt_tokens: int
    output_tokens: int

    def describe(self) -> str:
        return f"{self.streams}x{self.prompt_tokens}+{self.output_tokens}"


def plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[WarmupPhase]:
    """The phases, most informative first, sized within the engine's limits: prefill alone at three
    sizes, decode batches from 1 to the batch ceiling (doubling from 1 to 32, then the ceiling), and
    decodes over long prompts."""
    room = max(2, max_model_len - 17)  # a prompt and its 16 output tokens fit the model's length
    chunk = max(1, min(max_num_batched_tokens, room))

    def prompt(n: int) -> int:
        return max(1, min(n, chunk))

    def decode(streams: int) -> WarmupPhase:
        # a light load decodes 1-4 streams over chat-sized prompts; larger batches run over short
        # prompts (their prefill is ``streams`` times longer), the largest for fewer steps
        short = streams <= 4
        output = 8 if streams == max_num_seqs and streams > 32 else 16
        return WarmupPhase(streams, prompt(64) if short else 16, output)

    batches = sorted({min(b, max_num_seqs) for b in (2, 4, 8, 16, 32, max_num_seqs)} - {1})
    phases = [WarmupPhase(1, prompt(64), 1), WarmupPhase(1, 16, 16), WarmupPhase(1, prompt(256), 1)]
    phases += [decode(b) for b in batches]
    phases += [WarmupPhase(1, prompt(1024), 1), WarmupPhase(min(4, max_num_seqs), prompt(512), 16)]
    return phases


def fit_steps(steps: Sequence[EngineStep]) -> tuple[StepCoefficients, float | None]:
    """The step-cost model fitted to ``steps`` alone (no forgetting, no prior), and its median
    relative error over them."""
    model = StepCostModel(FitSettings(forgetting=1.0, mix_forgetting=1.0, max_rejects=len(steps) + 1))
    model.update(steps)
    coefficients = model.coefficients
    errors = [
        abs(s.step_s - model.predict_step(s.prefill_tokens, s.decode_seqs, s.kv_tokens)) / s.step_s
        for _, s in costs(steps)
        if s.step_s > 0
    ]
    return coefficients, (statistics.median(errors) if errors else None)


def seed_from_warm_up(
    model: StepCostModel, steps: Sequence[EngineStep], seconds: float
) -> tuple[StepCoefficients, float | None]:
    """Seed ``model`` with the fit of a warm-up's ``steps`` (``seconds`` long) as a prior of
    ``PRIOR_SAMPLES`` steps, as the daemon and the twin both do; the fit and its median error."""
    coefficients, error = fit_steps(steps)
    name = f"warm-up: {len(steps)} steps in {seconds:.1f} s"
    model.reset(CostPrior(coefficients, name=name, prior_samples=PRIOR_SAMPLES))
    return coefficients, error
