"""TTFT bounds in the gate: under SLO steering a request that cannot reach its first token within its
class's TTFT bound is refused at once (429 + Retry-After) rather than served late, and a queued one
whose bound passes gets 429 (``[slo]``, resolved per class; refusals count as misses in goodput).

A request's predicted TTFT is its expected wait (its place in the queue over the rate at which slots
free up) plus its own prefill, which a ``PrefillEstimator`` predicts (the step-cost model,
``controller/control/stepcost.py``, through ``controller/control`` wiring: admission imports nothing
of it). It must stay within the class's queue deadline, which becomes ``min(queue_deadline_s,
wait_share * TTFT bound)``: the rest of the bound is a margin for what the prediction misses (held to
the whole bound, the twin's H200 conversation run lost 2.6 % of its goodput), and a queued request
granted a slot just at its bound would miss it.

A request may carry a TTFT bound of its own (a gateway's header: ``engine/frontend/objectives.py``).
It only tightens its class's: the request is held to ``min(its own, its class's)`` (``bound_s``), its
own alone where its class has none (no ``[slo]``), and the prediction and the queue deadline above
run against that, counted from when it reached the server.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controller.admission.classes import PriorityClass
from controller.clock import Clock
from controller.percentile import percentile


class PrefillEstimator(Protocol):
    """Seconds the engine takes to prefill a prompt of ``prompt_tokens``, and the prompts it holds
    that have had no first token, which a new request's first token waits behind (0 when it cannot
    tell)."""

    def prefill_s(self, prompt_tokens: int, uncached: int | None = None) -> float: ...

    def uncached_tokens(self, prompt_tokens: int) -> int: ...

    def backlog_s(self) -> float: ...


@dataclass(frozen=True)
class TtftBounds:
    """Each class's TTFT bound (seconds), and what predicts a request's own prefill."""

    bounds: Mapping[str, float] = field(default_factory=dict)
    prefill: PrefillEstimator | None = None
    wait_share: float = 1.0
    """The share of the TTFT bound a request may spend queued: the rest is for its prefill and first
    step once it has a slot (a request granted a slot at its bound misses it)."""

    def bounded(self, classes: Sequence[PriorityClass]) -> list[PriorityClass]:
        """``classes`` with each queue deadline cut to ``wait_share`` of its class's TTFT bound where
        that is shorter."""
        out = []
        for c in classes:
            bound = self.bounds.get(c.name)
            if bound is not None and bound * self.wait_share < c.queue_deadline_s:
                c = dataclasses.replace(c, queue_deadline_s=bound * self.wait_share)
            out.append(c)
        return out

    def bound_s(self, name: str, asked_s: float | None = None) -> float | None:
        """The TTFT bound a request of class ``name`` is held to: its class's, tightened by the
        request's own ``asked_s`` where it names one (never loosened, never below
        ``MIN_OWN_TTFT_S``); None when neither sets one."""
        bound = self.bounds.get(name)
        if asked_s is None:
            return bound
        asked_s = max(asked_s, MIN_OWN_TTFT_S)
        return asked_s if bound is None else min(bound, asked_s)

    def queue_deadline_s(self, spec: PriorityClass, asked_s: float | None = None) -> float:
        """The queue deadline of a request of class ``spec`` (as ``bounded`` cut it) that names its
        own TTFT bound ``asked_s``: cut further to ``wait_share`` of the bound it is held to."""
        bound = self.bound_s(spec.name, asked_s)
        if asked_s is None or bound is None:
            return spec.queue_deadline_s
        return min(spec.queue_deadline_s, bound * self.wait_share)

    def backlog_s(self) -> float:
        """The engine's prefill backlog: what a request's first token waits behind once it has a
        slot, besides its own prefill; 0 without an estimator or without bounds."""
        if self.prefill is None or not self.bounds:
            return 0.0
        return max(0.0, self.prefill.backlog_s())

    @property
    def uses_prompt_length(self) -> bool:
        """Whether a request's prompt length changes its check (only with a prefill estimator)."""
        return self.prefill is not None

    def prefill_s(self, prompt_tokens: int | None, uncached: int | None = None) -> float:
        """The request's own prefill (of its ``uncached`` tokens where known: the estimator's
        expectation otherwise); 0 without an estimator or a known prompt length (the daemon reads it
        off the input vLLM rendered: ``engine/frontend/client.py``)."""
        if self.prefill is None or not prompt_tokens:
            return 0.0
        return max(0.0, self.prefill.prefill_s(prompt_tokens, uncached))

    def uncached_tokens(self, prompt_tokens: int | None) -> int | None:
        """The tokens of the prompt the estimator expects the engine to prefill (None without one)."""
        if self.prefill is None or not prompt_tokens:
            return None
        return self.prefill.uncached_tokens(prompt_tokens)

    def cache_miss_s(self, prompt_tokens: int | None, assumed: int | None, cached: int | None) -> float:
        """What a request's prefill took beyond (or short of) its prediction because the prefix
        cache served ``cached`` of its ``prompt_tokens`` where the prediction ``assumed`` it would
        prefill that many: both prefills as the estimator costs them now; 0 where either is unknown."""
        if assumed is None or cached is None or not prompt_tokens:
            return 0.0
        actual = max(1, prompt_tokens - cached)
        return self.prefill_s(prompt_tokens, actual) - self.prefill_s(prompt_tokens, assumed)


MIN_OWN_TTFT_S = 0.1
"""The tightest TTFT bound a request may ask for itself (a gateway's header): below it, what the
front end alone takes on a loaded host, it is held to this (a 1 ms header is a bound no server meets,
and any client can send one)."""


NO_BOUNDS = TtftBounds()
"""The gate without SLO steering: queue deadlines as configured, no prefill term."""


class AfterSlot:
    """How long a request takes from its slot to its first token beyond its predicted prefill,
    measured per served request: waiting in the engine behind the running batch, and a prefill
    chunked among the decodes of a loaded step, which the model's standalone prefill leaves out.
    Under SLO steering the gate adds a high quantile of it to every prediction and takes it off the
    queue deadline, so that what it admits and grants can still meet its bound (without it the
    twin's 250 ms SLO run at 2x load admitted 7.5 % that then missed it).

    The time a request spent in the engine's own waiting queue is counted at its median, the rest at
    the high quantile. That queue is the admission limit's: a steady one (the limit's headroom above
    what runs) is in every request's wait, so the median carries it; a burst admitted before the slo
    policy cut the limit to what runs is gone with the cut, and at the high quantile it held the
    prediction for the whole window (SmolLM2 at a code-trace burst: 3.9 s against a 5 s bound, so
    for 30 s every queued request got 1.1 s and the gate refused 36 requests while the engine stood
    idle). Left out altogether, the twin's H200 conversation run, whose engine always holds the
    headroom's queue, lost 2.3 % of its goodput to TTFT misses. The window is ten seconds, so that a
    burst's samples leave soon after it (the same SmolLM2 load, with the outcome ledger's first-token
    fix: 170 good requests and 28 refused, against 167 and 36 before both; the twin's three hour-long
    `h200-8b` loads moved by at most 0.1 %).

    ``bounds`` returns the gate's ``TtftBounds`` now (a reload replaces them)."""

    def __init__(
        self,
        clock: Clock,
        bounds: Callable[[], TtftBounds],
        window_s: float = 10.0,
        quantile: float = 90.0,
        min_samples: int = 20,
    ) -> None:
        self._clock, self._bounds = clock, bounds
        self.window_s, self.quantile, self.min_samples = window_s, quantile, min_samples
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=4096)
        """(when recorded, seconds beyond the engine's queue and the predicted prefill (at least 0),
        seconds in the engine's queue)."""
        self._quantile: float | None = None
        """``seconds()`` of the window as it is; None once a sample came or went (every admission
        check and every waiter's deadline reads it, so it is not sorted again each time)."""
        self._queued = 0.0
        """The median time in the engine's queue that ``seconds()`` holds."""

    def first_token(
        self, after_slot_s: float, prompt_tokens: int | None, engine_queue_s: float = 0.0
    ) -> None:
        """A request reached its first token ``after_slot_s`` after its slot, ``engine_queue_s`` of it
        in the engine's waiting queue (the engine client tells, the twin too): under SLO steering what
        that took beyond its prefill is a sample, its queue apart."""
        ttft = self._bounds()
        if ttft.bounds:
            queued = min(max(0.0, engine_queue_s), max(0.0, after_slot_s))
            beyond = after_slot_s - queued - ttft.prefill_s(prompt_tokens)
            self._samples.append((self._clock(), max(0.0, beyond), queued))
            self._quantile = None

    def seconds(self) -> float:
        """The window's ``quantile`` of the time beyond the engine's queue and the prefill, plus the
        median time in the engine's queue; 0 below ``min_samples`` (too few to tell)."""
        horizon = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
            self._quantile = None
        if self._quantile is None:
            self._quantile, self._queued = 0.0, 0.0
            if len(self._samples) >= self.min_samples:
                beyond = percentile([s for _, s, _ in self._samples], self.quantile, "nearest_rank")
                self._queued = percentile([q for _, _, q in self._samples], 50.0, "nearest_rank") or 0.0
                self._quantile = (beyond or 0.0) + self._queued
        return self._quantile

    def own_s(
        self,
        prompt_tokens: int | None,
        arrived_mono: float | None = None,
        bounded: bool = False,
        backlog_s: float = 0.0,
    ) -> float:
        """What a request's TTFT holds besides its wait in the queue: its prefill, and under a bound
        (the classes', or the request's own: ``bounded``) ``seconds()``, the engine's prefill
        backlog (``backlog_s``: the gate reads ``TtftBounds.backlog_s`` once a check) and the time
        since it reached the server (``arrived_mono``, where known: the front end's parsing,
        templating and tokenizing, seconds on a loaded CPU).

        The backlog and the engine queue's median in ``seconds()`` are one wait seen twice: a
        request enters the engine's queue behind the prompts it has yet to prefill. The larger
        counts (the backlog as the engine holds it now, the median as it was learned). With their
        sum the twin's SmolLM2 conversation load (``cpu-conv``, three seeds) served 1.005x its best
        static point, 92 % of what it admitted good; with the larger 1.026x and 96 % (the other
        twelve knee loads within 0.4 %)."""
        ttft = self._bounds()
        if not ttft.bounds and not bounded:
            return ttft.prefill_s(prompt_tokens)
        lag = self.seconds()
        return self.sure_s(prompt_tokens, arrived_mono, backlog_s) + lag - min(self._queued, backlog_s)

    def sure_s(self, prompt_tokens: int | None, arrived_mono: float | None, backlog_s: float) -> float:
        """The step-cost model's part of ``own_s``: the request's prefill behind the engine's
        ``backlog_s``, and the time since it arrived (no learned lag)."""
        spent = 0.0 if arrived_mono is None else max(0.0, self._clock() - arrived_mono)
        return self._bounds().prefill_s(prompt_tokens) + spent + backlog_s

    def deadline_from(
        self, spec: PriorityClass, now: float, arrived_mono: float | None, asked_s: float | None = None
    ) -> float:
        """What a request of class ``spec`` queued ``now`` counts its queue deadline from: under a
        TTFT bound (its class's or its own ``asked_s``), when it reached the server (the bound is the
        client's), else ``now``."""
        if arrived_mono is None or self._bounds().bound_s(spec.name, asked_s) is None:
            return now
        return min(now, arrived_mono)

    def queue_deadline_s(self, spec: PriorityClass, asked_s: float | None = None) -> float:
        """The queue deadline now of a request of class ``spec`` with its own TTFT bound ``asked_s``
        (None: its class's alone): a request granted its slot later than its bound less
        ``seconds()`` would miss the bound."""
        ttft = self._bounds()
        bound, lag, deadline = (
            ttft.bound_s(spec.name, asked_s),
            self.seconds(),
            ttft.queue_deadline_s(spec, asked_s),
        )
        if bound is None or lag <= 0:
            return deadline
        return min(deadline, max(0.0, bound - lag))


class TtftCheck:
    """Each admitted request's predicted TTFT against its measured one, per class: the promise the
    gate admits under, checked. The prediction (``AdmissionGate.check_admission``: the time since it
    arrived, its expected wait in the queue, its prefill and the after-slot lag) is corrected by what
    the class's last requests measured beyond it (at most ``window`` of them, none older than
    ``window_s``): the gate admits where the prediction plus the ``quantile`` of those residuals is
    within the bound, so the prediction's bias and spread, whatever their source (a front end slower
    than the twin's, a cold prefix cache, a queue that drains slower than it filled), are paid for in
    refusals, not in misses of requests it admitted. A negative correction (the prediction too
    careful: refusals the engine could have served in time) loosens the check, by at most
    ``max_loosen`` of the bound. The samples age out: a correction measured while the engine was
    congested must not outlive the congestion (a check that refuses every request sees no new
    samples). It joins the expected-wait check only: a request that finds a slot free was refused
    by it, on the twin's H200 shared-prefix load at 40 req/s, for 25 s while the engine stood idle.

    Each residual is taken against the prediction as it would be made now: the after-slot lag
    (``AfterSlot.seconds``, part of every prediction, passed as ``lag``) at the request's admission
    is replaced by the lag now. A burst's first requests miss by what the lag had not yet learned;
    once it has, the same seconds stand in every prediction, and the correction counted them a
    second time (SmolLM2, the moderate phase-changing load: 2.0 s of lag plus 4.7 s of correction
    against a 5 s bound refused 35 requests in 4 s while those it admitted met it).

    So is the prefill of what the request's own prefix-cache hits (vLLM's ``num_cached_tokens``,
    known at its first token) left to compute in place of what the prediction assumed from the
    cache's recent share (``cache_s``: ``TtftBounds.cache_miss_s``). The check corrects the
    prediction's bias, which a request's luck with the cache is not: at a run's start the cold
    prefixes' residuals (0.5-0.7 s on the twin's SmolLM2 shared-prefix loads, 4 prefixes of 480
    tokens) refused for 10-20 s requests the engine served at 0.2-0.3 s."""

    def __init__(
        self,
        clock: Clock,
        window: int = 100,
        window_s: float = 20.0,
        quantile: float = 90.0,
        min_samples: int = 10,
        max_loosen: float = 0.25,
        lag: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._clock, self.window, self.window_s = clock, window, window_s
        self.quantile, self.min_samples, self.max_loosen = quantile, min_samples, max_loosen
        self._lag = lag
        self._by_class: dict[str, deque[tuple[float, float, float]]] = {}
        """Per class, (when, predicted less the lag it held, measured TTFT seconds) of its last
        admitted requests."""

    def record(
        self, cls: str, predicted_s: float, measured_s: float, lag_s: float = 0.0, cache_s: float = 0.0
    ) -> None:
        """A request of ``cls`` admitted with ``predicted_s``, of which ``lag_s`` was the after-slot
        lag then, got its first token ``measured_s`` after it reached the server; ``cache_s``: what
        its own prefix-cache hits made its prefill take beyond the prediction's
        (``TtftBounds.cache_miss_s``), taken out of the residual."""
        seen = self._by_class.setdefault(cls, deque(maxlen=self.window))
        seen.append((self._clock(), predicted_s - lag_s + cache_s, measured_s))

    def _recent(self, cls: str) -> list[tuple[float, float]]:
        """(predicted as now, with the lag now; measured) of ``cls``'s samples in the window."""
        seen = self._by_class.get(cls)
        if not seen:
            return []
        horizon = self._clock() - self.window_s
        while seen and seen[0][0] < horizon:
            seen.popleft()
        lag = self._lag()
        return [(p + lag, m) for _, p, m in seen]

    def correction_s(self, cls: str, bound_s: float | None = None) -> float:
        """Seconds to add to a prediction in ``cls``: the ``quantile`` of measured - predicted; 0
        below ``min_samples``; at least ``-max_loosen * bound_s``."""
        recent = self._recent(cls)
        if len(recent) < self.min_samples:
            return 0.0
        residual = percentile([m - p for p, m in recent], self.quantile, "nearest_rank") or 0.0
        floor = -self.max_loosen * bound_s if bound_s is not None else 0.0
        return max(floor, residual)

    def state(self) -> dict[str, dict[str, float | int | None]]:
        """/state's ``ttft_check``: per class, the samples, the median predicted and measured TTFT,
        the median residual (bias) and the correction in force (bias and spread)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for cls in list(self._by_class):
            recent = self._recent(cls)
            out[cls] = {
                "samples": len(recent),
                "predicted_p50_s": percentile([p for p, _ in recent], 50.0, "nearest_rank"),
                "measured_p50_s": percentile([m for _, m in recent], 50.0, "nearest_rank"),
                "bias_s": percentile([m - p for p, m in recent], 50.0, "nearest_rank"),
                "correction_s": self.correction_s(cls),
            }
        return out
