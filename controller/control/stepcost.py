"""The online step-cost model: ``step_s = a + b*prefill + c*decode_seqs + d*kv_tokens`` (the twin's
form, ``policies/cost.StepCoefficients``) fitted to the engine's steps as they come, by recursive least
squares with exponential forgetting, so the fit follows the hardware as it is now (a neighbour on the
CPU, a warmer GPU) and not as it was an hour ago.

The numerics, and why:

* **Scaled features.** Tokens run in the thousands and decode sequences in tens; each feature is
  divided by a typical step's value (``SCALES``) so the covariance stays well conditioned.
* **Relative error.** Each step is weighted by 1 / its time, as the profile fit does
  (``controller/sim/fit.py``): a 2 ms decode and a 200 ms prefill weigh the same, and the fit
  minimises the relative error it reports.
* **A seed is a prior.** A profile's coefficients start the fit with the weight of
  ``prior_samples`` steps, each measuring one term alone; data overrides it at that rate. A term the
  load never excites (prefill, on a decode-only load) keeps the seed's value instead of drifting.
* **Covariance cap.** Forgetting divides the covariance by ``forgetting`` every step, so a direction
  that the load does not excite grows without bound (wind-up) until one step of it moves the fit
  wildly. Its eigenvalues are clipped to the uncertainty of ``cap_samples`` typical steps (and floored,
  so it stays positive definite, never singular).
* **Outliers.** Once warmed up, a step whose time is off the prediction by more than
  ``max(outlier_ratio, exp(outlier_sigmas * recent log spread))`` (a GC pause, a step that waited) is
  counted and skipped. ``max_rejects`` of them among the last ``window`` steps say the model is wrong,
  not the steps (the engine changed, or a kind of step recurs that the fit has not learnt, such as
  the first long prefills on a CPU where they take seconds): the fit takes them in and reopens its
  covariance to learn again.
* **Non-negative coefficients.** A negative cost is meaningless (and it extrapolates badly); a fit
  that goes negative is projected onto the non-negative coefficients nearest in the covariance's
  metric (fixing a term at 0 and conditioning the others on it).

``ready`` needs ``min_samples`` steps taken in (none, with a seed: a profile fitted on this hardware is
trusted from the start, and a slow engine, 5 steps a second on a CPU, would hold every knob for ten
seconds otherwise) and the last within ``max_age_s``: a policy holds its knobs otherwise, and says the
estimate's ``reason``.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from controller.control.steps import EngineStep, StepCost, costs
from policies.cost import CostEstimate, StepCoefficients

SCALES = np.array([1.0, 1024.0, 64.0, 65536.0])
"""A typical step's features (1, prefill tokens, decode sequences, KV tokens): the fit works in
coefficients times these, seconds each term adds to such a step."""
NO_PRIOR_VAR = 100.0
"""Covariance without a seed: a term may add up to about ten seconds to a typical step (knows nothing:
a 1024-token prefill of a 135M model takes 8 s on a 2-core CPU, 0.1 s for an 8B model on an H200)."""


MIX_STEPS = 20
"""Steps (a sum with the forgetting factor) before the prefill mix is read. The first steps of a load
are its prompts alone, so an early mix over-counts prefill: the slo policy then runs fewer requests
for a few seconds, the careful side. Until it is read the policy runs the whole cap, the bold side:
at a tenth of the fit's memory (100 steps, 7 s on a CPU) the twin's shared-prefix start admitted
twelve requests that then missed their TTFT."""


@dataclass(frozen=True)
class CostPrior:
    """A seed: a profile's ``[cost]`` coefficients and the weight they start with."""

    coefficients: StepCoefficients
    name: str = ""
    """The profile's name, shown in /state."""
    prior_samples: float = 20.0
    """The seed weighs as much as this many steps, each measuring one term alone."""


@dataclass(frozen=True)
class FitSettings:
    """How the fit learns and when it is trusted (the defaults suit an engine stepping 10-1000 times a
    second)."""

    forgetting: float = 0.999
    """Weight of the past per step: the fit's memory is about 1 / (1 - forgetting) steps."""
    mix_forgetting: float = 0.995
    """The same for the load's mix (prefill per decode, KV per sequence): 200 steps, 10 s on a CPU.
    A load's mix moves faster than the hardware's cost: over the fit's 1,000 steps a shared-prefix
    load's cold start (its prefixes prefilled whole) weighed for a minute, and the slo policy ran
    half the requests it could (in the twin: 10.2 prefill per decode at 7 s, 3.2 at 80 s). Over 200
    steps the twin's H200 shared-prefix loads served 8-9 % more, the CPU's the same (three seeds)."""
    min_samples: int = 50
    """Steps taken in before the estimate is ready."""
    max_age_s: float = 60.0
    """The estimate is stale (not ready) when its last step is older than this."""
    window: int = 256
    """Steps the fit quality (relative RMS error, R^2) is measured over."""
    warmup: int = 20
    """No step is rejected as an outlier before this many were taken in."""
    outlier_ratio: float = 3.0
    """A step this many times slower (or faster) than predicted is an outlier, at least."""
    outlier_sigmas: float = 5.0
    """... or this many times the recent RMS of log(measured / predicted), if that is wider."""
    max_rejects: int = 20
    """Outliers among the last ``window`` steps after which the model is taken to be wrong: the next
    steps are taken in."""
    cap_samples: float = 2.0
    """The covariance never grows past the uncertainty of this many typical steps."""
    min_step_s: float = 1e-5
    """Floor of a step's time in its weight (a step reported as 0 s would weigh infinitely)."""


def prior_from(cost: StepCoefficients, name: str, prior_samples: float = 20.0) -> CostPrior:
    """A seed from a profile's step coefficients (``controller/profiles/load.py``, ``Profile.cost``)."""
    return CostPrior(cost, name=name, prior_samples=prior_samples)


def fittable(step: StepCost) -> bool:
    """A step the fit takes in: a positive, finite time and some work scheduled."""
    return math.isfinite(step.step_s) and step.step_s > 0 and step.prefill_tokens + step.decode_seqs > 0


class StepCostModel:
    """Recursive least squares over the scheduler's figures of ``EngineStep`` records (a
    ``StepConsumer``: ``update``)."""

    def __init__(self, settings: FitSettings | None = None, prior: CostPrior | None = None) -> None:
        self.settings = settings or FitSettings()
        self.reset(prior)

    def reset(self, prior: CostPrior | None) -> None:
        """Start over from ``prior`` (a reload that names another cost profile): nothing learnt stays."""
        self.prior = prior
        if prior is None:
            self._theta = np.zeros(4)
            self._p = np.eye(4) * NO_PRIOR_VAR
        else:
            theta = np.array(prior.coefficients.vector(), dtype=float) * SCALES
            spread = np.maximum(theta, 0.1 * float(theta.sum()) or 1e-3)  # a 0 term is not certain
            self._theta, self._p = theta, np.diag(spread**2 / prior.prior_samples)
        self.samples = self.rejected = self.last_decode_seqs = 0
        self._verdicts: deque[bool] = deque(maxlen=self.settings.window)
        """Whether each of the last steps judged was an outlier."""
        self._last_t: float | None = None
        self._y_ref: float | None = None
        """Typical step time (moving mean): sets the covariance cap."""
        self._log_var, self._spread_n = 0.0, 0
        """Moving mean of log(measured / predicted)^2, and how many steps it has seen."""
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.settings.window)
        self._kv_sum = 0.0
        """Sum of kv_tokens with ``mix_forgetting``, over the steps of ``_mix``: over its decode
        seqs, the KV a step reads per sequence it decodes (``CostEstimate.kv_tokens_per_seq``)."""
        self._mix = (0.0, 0.0, 0.0)
        """Sums of prefill tokens, decode seqs and steps, each with ``mix_forgetting``
        (``CostEstimate.prefill_per_decode``)."""
        self._pace = (0.0, 0.0, 0.0)
        """Sums, with the forgetting factor, over the decoding steps since the fit was trusted: their
        wall-clock time (step and the gap before it), the fit's prediction of them, and their count
        (``CostEstimate.pace``)."""

    # -- learning ---------------------------------------------------------------------------------
    def update(self, steps: Sequence[EngineStep]) -> None:
        """Take in a tick's steps, oldest first (the ``StepFeed`` consumer). Each is predicted by the
        fit as it was before the batch; the kept ones update it at once, in information form (the same
        result as one recursive update per step, with one small inverse per batch)."""
        kept = [(t, s) for t, s in costs(steps) if fittable(s)]
        if not kept:
            return
        self._track_batch([s for _, s in kept])
        self.last_decode_seqs = kept[-1][1].decode_seqs
        x = np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.kv_tokens] for _, s in kept]) / SCALES
        y = np.array([s.step_s for _, s in kept])
        pred = x @ self._theta
        self._track_pace([s for _, s in kept], pred)
        keep = []
        relearn = False  # once the model is found wrong, this batch's predictions are stale
        for yi, pi in zip(y, pred, strict=True):
            relearn = relearn or self._is_wrong()
            keep.append(relearn or not self._is_outlier(float(yi), float(pi)))
        if relearn:
            self._verdicts.clear()
        if not any(keep):
            return
        self._learn(x[keep], y[keep])
        for (t_mono, _), yi, pi in itertools.compress(zip(kept, y, pred, strict=True), keep):
            self._track(float(yi), float(pi), t_mono)

    def _track_batch(self, steps: Sequence[StepCost]) -> None:
        """The KV read and the prefill/decode mix of the steps, as sums with ``mix_forgetting``. KV
        per decoding sequence is a ratio of the sums, not a mean of each step's ratio: a step that
        decodes one sequence beside three prompts reads four requests' KV, and its ratio
        (about 4x a decode's) would weigh as much as a step of forty decodes (a mean of ratios read
        1,100-1,800 KV tokens a sequence on SmolLM2 where each held about 300)."""
        lam = self.settings.mix_forgetting
        for s in steps:
            p, d, n = self._mix
            self._mix = (lam * p + s.prefill_tokens, lam * d + s.decode_seqs, lam * n + 1.0)
            self._kv_sum = lam * self._kv_sum + s.kv_tokens

    def _track_pace(self, steps: Sequence[StepCost], pred: np.ndarray) -> None:
        """The wall clock of the decoding steps against the fit's prediction of each, made before the
        step was taken in: outliers count (a step that waited took that long), the gap before the step
        too (``StepCost.gap_s``). Only once the fit is trusted: a fit still learning predicts anything."""
        if self.samples < self.min_samples:
            return
        lam = self.settings.forgetting
        for s, p in zip(steps, pred, strict=True):
            if s.decode_seqs > 0 and p > 0:
                wall, predicted, n = self._pace
                self._pace = (lam * wall + s.step_s + s.gap_s, lam * predicted + float(p), lam * n + 1.0)

    def _is_outlier(self, y: float, pred: float) -> bool:
        s = self.settings
        if self.samples < s.warmup or pred <= 0:
            return False
        log_ratio = abs(math.log(y / pred))
        limit = max(math.log(s.outlier_ratio), s.outlier_sigmas * math.sqrt(self._log_var))
        outlier = log_ratio > limit
        self._verdicts.append(outlier)
        if outlier:
            self.rejected += 1
        return outlier

    def _is_wrong(self) -> bool:
        """``max_rejects`` outliers among the last ``window`` steps: the engine has changed,
        or a kind of step recurs that the fit has never learnt (long prefills after a start of short
        ones, on hardware where they take seconds), not a pause now and then. What the fit knew is no
        evidence now: it reopens its covariance and learns anew."""
        if sum(self._verdicts) < self.settings.max_rejects:
            return False
        self._p, self._y_ref, self._log_var, self._spread_n = np.eye(4) * NO_PRIOR_VAR, None, 0.0, 0
        return True

    def _learn(self, x: np.ndarray, y: np.ndarray) -> None:
        """``info = forgetting^m * P^-1 + sum_i forgetting^(m-i) * r_i r_i^T`` over the rows ``r = x / y``
        (relative error), the coefficients solved from it, then kept non-negative and bounded."""
        lam, m = self.settings.forgetting, len(y)
        w = 1.0 / np.maximum(y, self.settings.min_step_s)
        r, target = x * w[:, None], y * w
        decay = lam ** np.arange(m - 1, -1, -1, dtype=float)
        vals, vecs = np.linalg.eigh(self._p)
        prior = (vecs / vals) @ vecs.T * lam**m  # P is kept positive definite (_bound_covariance)
        info = prior + (r * decay[:, None]).T @ r
        rhs = prior @ self._theta + (r * decay[:, None]).T @ target
        vals, vecs = np.linalg.eigh((info + info.T) / 2)
        vals = np.maximum(vals, float(vals.max()) * 1e-14)
        self._theta = (vecs / vals) @ (vecs.T @ rhs)
        self._p = (vecs / vals) @ vecs.T
        if (self._theta < 0).any():
            self._theta = _nonnegative(self._theta, self._p)
        self._bound_covariance()

    def _cap(self) -> float:
        """The most uncertain a direction may be: ``cap_samples`` typical steps' worth (before the
        warm-up, the no-seed covariance: a first few steps must be free to move the fit)."""
        if self._y_ref is None or self.samples < self.settings.warmup:
            return NO_PRIOR_VAR
        return max(self._y_ref, self.settings.min_step_s) ** 2 / self.settings.cap_samples

    def _bound_covariance(self) -> None:
        """Eigenvalues of the covariance within [cap * 1e-12, cap]: no wind-up, never singular."""
        cap = self._cap()
        vals, vecs = np.linalg.eigh((self._p + self._p.T) / 2)
        if float(vals.max()) > cap or float(vals.min()) < cap * 1e-12:
            self._p = (vecs * np.clip(vals, cap * 1e-12, cap)) @ vecs.T

    def _track(self, y: float, pred: float, t_mono: float) -> None:
        self.samples += 1
        self._last_t = t_mono if self._last_t is None else max(self._last_t, t_mono)
        alpha = 1.0 - self.settings.forgetting
        self._y_ref = y if self._y_ref is None else self._y_ref + alpha * (y - self._y_ref)
        if pred > 0 and self.samples > self.settings.warmup:  # the spread of a fit past its first steps
            self._spread_n += 1
            self._log_var += max(alpha, 1.0 / self._spread_n) * (math.log(y / pred) ** 2 - self._log_var)
        self._recent.append((y, pred))

    # -- reading ----------------------------------------------------------------------------------
    @property
    def min_samples(self) -> int:
        """Steps taken in before the fit is trusted: ``min_samples``, none with a seed (a fit of this
        box's own warm-up steps, or a profile of it: the policy sizes the knobs before the first
        request, not after a first burst went in at the initial limit)."""
        return 0 if self.prior is not None else self.settings.min_samples

    @property
    def coefficients(self) -> StepCoefficients:
        """The fit now, in the twin's and the policies' vocabulary."""
        return StepCoefficients.of(self._theta / SCALES)

    def predict_step(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        """The fit's step time for these features (``StepCoefficients.step_s``)."""
        return self.coefficients.step_s(prefill_tokens, decode_seqs, kv_tokens)

    def estimate(self, now_mono: float) -> CostEstimate:
        """The fit as a policy reads it, ``ready`` and its reason at ``now_mono``."""
        age = None if self._last_t is None else max(0.0, now_mono - self._last_t)
        rel, r2 = self._quality()
        s = self.settings
        if self.samples < self.min_samples:
            reason = f"cost model: {self.samples} samples < {self.min_samples}"
        elif age is not None and age > s.max_age_s:
            reason = f"cost model: last sample {age:.0f} s ago > {s.max_age_s:g} s"
        else:
            reason = "ready"
        coef = self.coefficients.coefficients()
        return CostEstimate(
            **coef,
            samples=self.samples,
            rejected=self.rejected,
            rel_error=rel,
            r2=r2,
            age_s=age,
            ready=reason == "ready",
            reason=reason,
            seed=self.prior.name if self.prior else "",
            kv_tokens_per_seq=self._kv_sum / self._mix[1] if self._mix[1] > 0 else None,
            prefill_per_decode=self._prefill_per_decode(),
            pace=self._pace_ratio(),
        )

    def _prefill_per_decode(self) -> float | None:
        """Prefill tokens per decoded token over the mix's memory; None until it holds ``MIX_STEPS``
        steps or any decode."""
        p, d, n = self._mix
        return p / d if n >= MIX_STEPS and d > 0 else None

    def _pace_ratio(self) -> float | None:
        """Wall clock per decoding step over the fit's prediction of it; None until a tenth of the
        fit's memory in such steps."""
        wall, predicted, n = self._pace
        return wall / predicted if self._holds_a_tenth(n) and predicted > 0 else None

    def _holds_a_tenth(self, n: float) -> bool:
        """``n`` steps (a sum with the forgetting factor) are a tenth of the fit's memory or more."""
        return n >= 0.1 / (1.0 - self.settings.forgetting)

    def _quality(self) -> tuple[float | None, float | None]:
        if not self._recent:
            return None, None
        y, pred = (np.array(v) for v in zip(*self._recent, strict=True))
        rel = float(np.sqrt(np.mean(((y - pred) / y) ** 2)))
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = None if ss_tot <= 0 else 1.0 - float(((y - pred) ** 2).sum()) / ss_tot
        return rel, r2


def _nonnegative(theta: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The non-negative coefficients nearest ``theta`` in the metric of covariance ``p``: over every
    set of terms held at 0, the others conditioned on it (the Gaussian conditional mean), the feasible
    one with the smallest Mahalanobis distance. Four terms: fifteen small solves at most."""
    best, best_dist = np.maximum(theta, 0.0), math.inf
    n = len(theta)
    for k in range(1, n + 1):
        for zero in itertools.combinations(range(n), k):
            z, f = list(zero), [i for i in range(n) if i not in zero]
            try:
                shift = np.linalg.solve(p[np.ix_(z, z)], theta[z])
            except np.linalg.LinAlgError:
                continue
            cand = np.zeros(n)
            cand[f] = theta[f] - p[np.ix_(f, z)] @ shift
            dist = float(theta[z] @ shift)
            if (cand >= -1e-15).all() and dist < best_dist:
                best, best_dist = np.maximum(cand, 0.0), dist
    return np.asarray(best, dtype=float)


class CostReader:
    """The model as the observer and the admin views read it: its estimate at the clock's now.
    ``budget``: the engine's token budget in force, for the gate's prefill term."""

    def __init__(
        self,
        model: StepCostModel,
        clock: Callable[[], float],
        budget: Callable[[], int] | None = None,
        cached_share: Callable[[], float | None] | None = None,
        awaiting: Callable[[], tuple[float, Sequence[tuple[float, int]]]] | None = None,
    ) -> None:
        self.model, self._clock, self._budget = model, clock, budget
        self._cached_share = cached_share
        """The share of recent prompts' tokens the prefix cache served (the telemetry window's)."""
        self._awaiting = awaiting
        """Seconds since the engine's last first token, and (seconds in the engine, prompt tokens)
        of each request there with no first token yet, oldest first (the outcome ledger's
        ``awaiting_first_token``)."""
        self._share: tuple[float, float] | None = None
        """(when read, the share): read at most once a second, not at every admission check."""
        self.warm_start: dict[str, Any] | None = None
        """How the model started (``lifecycle/warm.WarmStart``), once the daemon has started it."""

    def current(self) -> CostEstimate:
        return self.model.estimate(self._clock())

    def cached_share(self) -> float:
        """The prefix cache's share of recent prompt tokens (0 without a source or a figure)."""
        if self._cached_share is None:
            return 0.0
        now = self._clock()
        if self._share is None or now - self._share[0] >= 1.0:
            self._share = (now, self._cached_share() or 0.0)
        return self._share[1]

    def uncached_tokens(self, prompt_tokens: int) -> int:
        """The tokens of a prompt of ``prompt_tokens`` the engine is expected to prefill: less the
        share the prefix cache served recent prompts (a request's own hits are known only once it
        ran), at least one."""
        return max(1, math.ceil(prompt_tokens * (1.0 - self.cached_share())))

    def prefill_s(self, prompt_tokens: int, uncached: int | None = None) -> float:
        """The gate's prefill term (``admission/ttft.PrefillEstimator``): one step of the prompt alone,
        ``a + b * P``; while ``D`` streams decode (the latest step's), the engine gives the prompt
        chunks of ``T - D`` tokens of the budget ``T`` beside them, each step paying ``a + c * D``:
        ``ceil(P / (T - D)) * (a + c * D) + b * P``, with ``P`` the prompt's ``uncached`` tokens
        (``uncached_tokens`` where not given). 0 until the fit is trusted (no guess refuses anyone)."""
        if self.model.samples < self.model.min_samples:
            return 0.0
        prompt_tokens = max(1, self.uncached_tokens(prompt_tokens) if uncached is None else uncached)
        d = self.model.last_decode_seqs
        if self._budget is None or d <= 0:
            return max(0.0, self.model.predict_step(prompt_tokens, 0, 0))
        k = self.model.coefficients
        steps = math.ceil(prompt_tokens / max(1, self._budget() - d))
        return max(0.0, steps * (k.a_s + k.c_s_per_decode_seq * d) + k.b_s_per_prefill_token * prompt_tokens)

    def backlog_s(self) -> float:
        """The gate's backlog term (``admission/ttft.PrefillEstimator``): how long the engine still
        takes to prefill the prompts it holds that have had no first token, before a new request's
        own prefill starts. vLLM's scheduler serves its waiting queue in order, so the ledger's
        requests form a queue: each one's prompt, less the prefix cache's recent share, takes
        ``P / (T - D)`` steps of ``a + c * D`` beside the ``D`` decodes and ``b * P``, and starts when
        it entered the engine or when the one before it finished (the first, when the engine last
        gave a first token); what is left of the last one's finish is the backlog. Two 818-token
        prompts on SmolLM2 at a budget of 36 took 3 s, and the ten requests admitted behind them
        missed a 2 s bound the gate had predicted them within. 0 until the fit is trusted."""
        if self._awaiting is None or self.model.samples < self.model.min_samples:
            return 0.0
        since_first, awaiting = self._awaiting()
        if not awaiting:
            return 0.0
        k, d = self.model.coefficients, self.model.last_decode_seqs
        per_token = k.b_s_per_prefill_token
        if self._budget is not None:
            per_token += (k.a_s + k.c_s_per_decode_seq * d) / max(1, self._budget() - d)
        per_token *= 1.0 - self.cached_share()
        finish = -since_first  # seconds from now, negative: past
        for in_engine_s, tokens in awaiting:
            finish = max(finish, -in_engine_s) + tokens * per_token
        return max(0.0, finish)
