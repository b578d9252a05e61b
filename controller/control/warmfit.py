"""The warm-up's plan and fit, without the engine: the daemon runs the plan through vLLM
(``engine/runtime/warmup.py``, ``lifecycle/warm.py``), the twin through its engine model
(``sim/run.py``), and both fit the steps they measured the same way.

The phases excite each term of ``step = a + b*prefill + c*decode_seqs + d*kv_tokens`` apart: a prompt
alone (``b``), batches of short streams (``c``), and a few streams over long prompts (``d``), in order
of what they teach, so a budget that runs out drops the least informative. The plan runs once, on the
engine just built: a warm engine stepping back to back is faster than one serving (on a 2-core CPU,
the tiny model's decode steps in later passes fitted an intercept 15 % below the served steps',
where the first pass fitted it within 6 %: docs/results/warmup.md).

The fit minimises the steps' absolute relative error (least squares reweighted towards it, ``fit_rows``), not
their squared error: a step's time on a shared CPU is its work plus delays that only ever add (a
neighbour's burst, a GC pause, the front end's turn on the core), and squares let those few slow
steps lift every coefficient, most of all the intercept of a model whose steps take a few
milliseconds, while the typical step, the one the median error asks about, is the fast one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from controller.control.stepcost import SCALES, CostPrior, StepCostModel, nonnegative
from controller.control.steps import EngineStep

PRIOR_SAMPLES = 20.0
"""The warm-up fit weighs as much as this many served steps."""
ROBUST_ITERATIONS = 30
"""Reweightings of the least-squares fit towards the least absolute relative error."""
ROBUST_FLOOR = 0.01
"""A step's weight is 1 / max(|relative error|, this): steps fitted closer than 1 % weigh alike, so
the reweighting stays finite and converges."""


@dataclass(frozen=True)
class Phase:
    """``streams`` requests at once, each of ``prompt_tokens`` random tokens, generating ``output_tokens``."""

    streams: int
    prompt_tokens: int
    output_tokens: int

    def describe(self) -> str:
        return f"{self.streams}x{self.prompt_tokens}+{self.output_tokens}"


def plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[Phase]:
    """The phases, most informative first, sized within the engine's limits: prefill alone at three
    sizes, decode batches from 1 to the batch ceiling, and decodes over long prompts."""
    room = max(2, max_model_len - 17)  # a prompt and its 16 output tokens fit the model's length
    chunk = max(1, min(max_num_batched_tokens, room))

    def prompt(n: int) -> int:
        return max(1, min(n, chunk))

    batches = sorted({min(b, max_num_seqs) for b in (1, 8, 32, max_num_seqs)})
    phases = [Phase(1, prompt(64), 1), Phase(1, 16, 16), Phase(1, prompt(256), 1)]
    phases += [Phase(b, 16, 16) for b in batches if b > 1]
    phases += [Phase(1, prompt(1024), 1), Phase(min(4, max_num_seqs), prompt(512), 16)]
    return phases


def fit_steps(steps: Sequence[EngineStep]) -> tuple[tuple[float, float, float, float], float | None]:
    """The step-cost model's coefficients (non-negative) that fit ``steps`` with the least absolute
    relative error (the module docstring says why), and the median relative error over them."""
    kept = [s for s in steps if s.step_s > 0 and s.prefill_tokens + s.decode_seqs > 0]
    if not kept:
        return (0.0, 0.0, 0.0, 0.0), None
    x = np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.kv_tokens] for s in kept])
    y = np.array([s.step_s for s in kept])
    coefficients = fit_rows(x, y)
    return coefficients, float(np.median(np.abs(x @ np.array(coefficients) - y) / y))


def fit_rows(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    """``fit_steps`` over features ``x`` (rows of 1, prefill tokens, decode sequences, KV tokens) and
    positive times ``y``: least squares of the relative error, reweighted ``ROBUST_ITERATIONS`` times
    by 1 / max(|relative error|, ``ROBUST_FLOOR``) towards the least absolute relative error."""
    rows = x / SCALES / y[:, None]
    weights = np.ones(len(y))
    for _ in range(ROBUST_ITERATIONS + 1):
        theta = _weighted_fit(rows, weights)
        weights = 1.0 / np.maximum(np.abs(rows @ theta - 1.0), ROBUST_FLOOR)
    a, b, c, d = (float(v) for v in theta / SCALES)
    return a, b, c, d


def _weighted_fit(rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-negative ``theta`` minimising ``sum(weights * (rows @ theta - 1)^2)``: the normal
    equations solved with their eigenvalues floored (a term no phase excited stays finite), and a
    negative term projected away in their metric (``stepcost.nonnegative``)."""
    info = (rows * weights[:, None]).T @ rows
    vals, vecs = np.linalg.eigh(info)
    vals = np.maximum(vals, float(vals.max()) * 1e-12)
    cov = (vecs / vals) @ vecs.T
    theta = cov @ (rows.T @ weights)
    return nonnegative(theta, cov) if (theta < 0).any() else theta


def seed_from_warm_up(
    model: StepCostModel, steps: Sequence[EngineStep], seconds: float
) -> tuple[tuple[float, float, float, float], float | None]:
    """Seed ``model`` with the fit of a warm-up's ``steps`` (``seconds`` long) as a prior of
    ``PRIOR_SAMPLES`` steps, as the daemon and the twin both do; the fit and its median error."""
    coefficients, error = fit_steps(steps)
    name = f"warm-up: {len(steps)} steps in {seconds:.1f} s"
    model.reset(CostPrior(coefficients, name=name, prior_samples=PRIOR_SAMPLES))
    return coefficients, error
