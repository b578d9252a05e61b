"""How each request ended, against its own SLO: counted live per class, and the window's goodput.

Outcomes: ``good`` (served within its bounds), ``ttft_missed`` (served, its first token later than
its TTFT bound; checked first), ``tpot_missed`` (served, first token in time, mean time per output
token over its TPOT bound), ``refused`` (429: a full queue, an expected wait past the deadline, shed,
or the queue deadline passed) and ``failed`` (503: shutting down, no engine able to serve, a restart
wait spent; or the engine ended it with an error or an abort). The definition of good is
``bench/records.meets_slo``'s: a request with fewer than two output tokens has no TPOT and passes
that part.

A request's bounds (``judged_bound``) are its class's ``[slo]`` bounds, its TTFT tightened by its own
where a gateway's header gave one (``engine/frontend/objectives.py``): ``min(class's, its own)``, the
bound the gate held it to, so a request the gate admitted against its own bound and served late is a
miss. Without ``[slo]`` its own TTFT bound is its only bound (no TPOT bound), and a request without
one is good (there is no bound to miss). A header's TPOT objective is not judged: nothing in the
daemon steers one request's pace (the batch cap and token budget serve every class's bound at once),
and a miss the daemon could not avoid would cut the slo policy's margin (``missed_total``), the
limit of every request, for one request's objective. Its own TTFT decides its outcome but not
``missed_total``, which counts by the class's bounds alone, for the same reason.

The TTFT a request is judged by is the client's: its time before the engine (from its arrival at the
server to its slot: the front end and the gate's queue wait, which the governed client knows and
tells ``started``) plus the engine's own TTFT (from the call into the engine, just after the slot, to
its first token, which the client reads off vLLM's request stats and tells ``first_token``; else
``e2e_latency - decode_time`` of vLLM's finished-request stats, which counts from vLLM's render, before
the gate). TPOT is vLLM's ``mean_time_per_output_token`` (decode time over the tokens after the first).

The served outcomes come from vLLM's stat logger (``engine/runtime/stats.py``), keyed by vLLM's
request id; a request the ledger was not told about (``started``) is counted in ``unmatched`` only,
never under a made-up class. Refusals come from the gate's events (``GateOutcomes``, which
``control/build.ControlCore`` puts in front of the caller's own, so the daemon and the twin count them
alike).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from controller.admission.classes import GateEvents, NoEvents
from controller.admission.errors import OWN_BOUND
from controller.admission.ttft import MIN_OWN_TTFT_S
from controller.clock import Clock, monotonic
from controller.control.steps import EngineStep
from controller.percentile import percentile
from policies.slo_targets import SloBound, SloTargets

OUTCOMES = ("good", "ttft_missed", "tpot_missed", "refused", "failed")
FAILED_REFUSALS = frozenset({"shutting_down", "engine_unavailable", "restart_wait"})
"""The gate's refusal reasons that answer 503 (the server could not serve); the others are 429s."""
ANSWER_SAMPLES = 256
"""Served requests whose output lengths ``answer_tokens`` reads: the last few minutes of a busy
engine, so a change of load shows within them."""
ANSWER_QUANTILE = 10.0
"""The output length ``answer_tokens`` reports: a short answer shares a prefill chunk's step over
fewer tokens, so the budget is sized for the shorter answers, not the mean (at the first quartile the
twin's H200 code phase, answers of 9 tokens and fewer, missed its TPOT bound 132 times in 2 minutes)."""
ASKED_RECENT = 32
"""The requests started lately whose ``max_tokens`` bound ``answer_tokens``: a few seconds of a busy
engine (in the twin's H200 phases, from chat to code, 32 gave 11.77 good req/s, 64 gave 11.74)."""
TPOT_SHARES = 256
"""Served requests whose TPOT, as a share of their class's bound, ``tpot_shares`` keeps: a look of
the slo policy's margin reads those served since its last (50 at most, or ten seconds' worth)."""
MAX_STARTED = 65_536
"""Requests remembered between ``started`` and their end; past it the oldest are forgotten (a request
vLLM never reports finished must not grow the ledger without bound)."""


def refusal_outcome(reason: str) -> str:
    """``failed`` for a refusal the server could not avoid (a 503), else ``refused`` (a 429)."""
    return "failed" if reason in FAILED_REFUSALS else "refused"


def judged_bound(cls_bound: SloBound | None, own_ttft_s: float | None) -> SloBound | None:
    """The bound a served request is judged by: its class's (``cls_bound``, None without ``[slo]``)
    with the TTFT tightened to ``own_ttft_s`` (a gateway's header; None: none asked); its own TTFT
    alone, with no TPOT bound, where its class has none."""
    if own_ttft_s is None:
        return cls_bound
    own_ttft_s = max(own_ttft_s, MIN_OWN_TTFT_S)  # as the gate held it (``TtftBounds.bound_s``)
    if cls_bound is None:
        return SloBound(own_ttft_s, math.inf)
    return SloBound(min(cls_bound.ttft_s, own_ttft_s), cls_bound.tpot_s)


def served_outcome(ttft_s: float, tpot_s: float | None, bound: SloBound | None) -> str:
    """A served request's outcome against ``bound`` (None: no ``[slo]``, always good)."""
    if bound is None:
        return "good"
    if ttft_s > bound.ttft_s:
        return "ttft_missed"
    if tpot_s is not None and tpot_s > bound.tpot_s:
        return "tpot_missed"
    return "good"


@dataclass
class _Started:
    cls: str
    before_engine_s: float
    left: int
    """Ends still expected (a request with ``n`` sequences ends ``n`` times in vLLM's stats)."""
    first_token_s: float | None = None
    """Seconds from entering the engine to the first token, as the engine client saw it arrive."""
    own_ttft_s: float | None = None
    """Its own TTFT bound (a gateway's header), which tightens its class's; None: none asked."""
    prompt_tokens: int = 0
    """Its prompt's tokens (0: not known)."""
    entered_mono: float = 0.0
    """When it entered the engine (the ledger's clock)."""
    prefilled: bool = False
    """Its first token came: told by its client (``first_token``), or counted in an engine step's
    first tokens (``on_steps``: the oldest waiting first)."""


class OutcomeLedger:
    """Counts each request's outcome (``count(cls, outcome)``: the metric) and keeps the window's."""

    def __init__(
        self,
        count: Callable[[str, str], None],
        window_s: float = 60.0,
        clock: Clock = monotonic,
        slo: Callable[[], SloTargets | None] = lambda: None,
    ):
        self._count, self.window_s, self._clock = count, window_s, clock
        self._slo = slo
        """``[slo]`` in force, read at each judgement (the control core's: ``ControlCore.slo``)."""
        self._started: dict[str, _Started] = {}
        self._last_first_mono = -math.inf
        """When the engine last gave a request its first token (``awaiting_first_token``)."""
        self._ended: deque[tuple[float, str, str]] = deque()
        """(time, class, outcome) of each request ended inside the window."""
        self.unmatched = 0
        """Served requests vLLM reported that no ``started`` named (not counted by class)."""
        self.served_total = 0
        """Requests served to the end (good or a bound missed; not failed) since the ledger started."""
        self.missed_total = 0
        """Of ``served_total``, those that missed their class's TTFT or TPOT bound: what the slo
        policy's ``mean_margin`` is steered by (the share of admitted requests that miss). A request's
        own tighter TTFT (``judged_bound``) decides its outcome, not this count: one client's header
        must not steer every client's margin."""
        self.queued_missed_total = 0
        """Of ``missed_total``, TTFT misses that spent most of their TTFT before the engine (in the
        gate's queue): a shortfall of capacity, as a refusal is, not of the engine's pace."""
        self._tpot_shares: deque[tuple[int, float]] = deque(maxlen=TPOT_SHARES)
        """(``served_total`` when it was served, its TPOT over its class's TPOT bound) of the last
        requests served with a TPOT (two tokens or more) under ``[slo]``."""
        self._answers: deque[int] = deque(maxlen=ANSWER_SAMPLES)
        """Output tokens of the last requests served (``answer_tokens``)."""
        self._asked: deque[int] = deque(maxlen=ANSWER_SAMPLES)
        """``max_tokens`` of the last requests started: the answer lengths until enough are served."""
        self._asked_mix: deque[tuple[int, int]] = deque(maxlen=ANSWER_SAMPLES)
        """(prompt tokens, ``max_tokens``) of the last requests started that said both."""
        self.refused_total = 0
        """Requests refused with a 429 (a full queue, an expected wait past the bound, a deadline)
        since the ledger started: set against ``missed_total``, whether a careful margin costs more
        requests than it saves."""

    def started(
        self,
        request_id: str,
        cls: str,
        before_engine_s: float,
        n: int = 1,
        ttft_s: float | None = None,
        max_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """A request of class ``cls`` enters the engine as vLLM's ``request_id``, ``before_engine_s``
        after it reached the server, with ``n`` sequences, its own TTFT bound ``ttft_s`` (a
        gateway's header, seconds; None: its class's alone) and the ``max_tokens`` it asked for
        (None: not said), what ``answer_tokens`` reads until enough answers are served, and its
        ``prompt_tokens`` (None: not known), what ``asked_prefill_per_decode`` reads."""
        if max_tokens is not None and max_tokens > 0:
            self._asked.append(max_tokens)
            if prompt_tokens is not None and prompt_tokens > 0:
                self._asked_mix.append((prompt_tokens, max_tokens))
        self._started.pop(request_id, None)  # a reused id: the latest attempt is the one that ends
        self._started[request_id] = _Started(
            cls,
            max(0.0, before_engine_s),
            max(1, n),
            own_ttft_s=ttft_s,
            prompt_tokens=max(0, prompt_tokens or 0),
            entered_mono=self._clock(),
        )
        while len(self._started) > MAX_STARTED:
            self._started.pop(next(iter(self._started)))

    def first_token(self, request_id: str, engine_ttft_s: float) -> None:
        """The engine client got ``request_id``'s first token ``engine_ttft_s`` after it entered the
        engine. ``served`` judges the TTFT by it: vLLM's finished stats give the first token only as
        ``e2e_latency - decode_time``, and ``e2e_latency`` ends when the front end processed the last
        output, so on a loaded CPU it carries the front end's backlog (SmolLM2 at a code-trace burst:
        4 TTFT misses counted of requests the client got within the bound, and the margin cut for them)."""
        entry = self._started.get(request_id)
        if entry is not None and entry.first_token_s is None:
            entry.first_token_s = max(0.0, engine_ttft_s)
            entry.prefilled = True
            # when it came, not when told: a client that does not stream is told at its end
            self._last_first_mono = max(self._last_first_mono, entry.entered_mono + entry.first_token_s)

    def on_steps(self, steps: Sequence[EngineStep]) -> None:
        """Engine steps (the step feed's, as they come): in each, as many of the requests without a first
        token as the step gave first tokens to (vLLM's ``time_to_first_tokens_iter``) have one now,
        the oldest first. vLLM's scheduler serves its queue in order, so the oldest are the ones,
        and this holds where a client does not stream, whose first output is its last: the engine
        client learns its first token only at its end (``first_token``), while its prompt's
        prefill is long done. A client that streams names its own (``first_token``); where one of
        the two named another request, the backlog loses that request's prompt (the careful side for
        the service: fewer refusals, as before the backlog was counted)."""
        left = sum(len(step.stats.ttft_s) for step in steps if step.stats is not None)
        if left <= 0:
            return
        self._last_first_mono = self._clock()
        for entry in self._started.values():
            if left <= 0:
                break
            if not entry.prefilled:
                entry.prefilled, left = True, left - 1

    def awaiting_first_token(self) -> tuple[float, tuple[tuple[float, int], ...]]:
        """The prefill backlog a new request's first token waits behind
        (``stepcost.CostReader.backlog_s``): seconds since the engine's last first token (``inf``
        before any), and (seconds since it entered the engine, prompt tokens) of each request in
        the engine that has had no first token, oldest first. Requests whose prompt length is not
        known are left out."""
        now = self._clock()
        return now - self._last_first_mono, tuple(
            (now - e.entered_mono, e.prompt_tokens)
            for e in self._started.values()
            if not e.prefilled and e.prompt_tokens
        )

    def served(
        self,
        request_id: str,
        engine_ttft_s: float,
        tpot_s: float | None,
        error: bool = False,
        output_tokens: int | None = None,
    ) -> str | None:
        """vLLM reported ``request_id`` finished: its outcome, counted; None when not ``started``.
        ``engine_ttft_s`` counts where the engine client saw no first token (``first_token``);
        ``output_tokens`` (where told) joins the answer lengths ``answer_tokens`` reads."""
        if output_tokens is not None and output_tokens > 0 and not error:
            self._answers.append(output_tokens)
        entry = self._started.get(request_id)
        if entry is None:
            self.unmatched += 1
            return None
        entry.left -= 1
        if entry.left <= 0:
            del self._started[request_id]
        if error:
            outcome = "failed"
        else:
            cls_bound = slo.for_class(entry.cls) if (slo := self._slo()) is not None else None
            bound = judged_bound(cls_bound, entry.own_ttft_s)
            if entry.first_token_s is not None:
                engine_ttft_s = entry.first_token_s
            ttft_s = entry.before_engine_s + engine_ttft_s
            outcome = served_outcome(ttft_s, tpot_s, bound)
            # the loop's margins are every client's: a request is judged for them by its class's
            # bounds alone, so a client's own tighter TTFT (a header: 1 ms) misses for that request,
            # never cutting the margin, the limit of all the others (the third review's finding 4)
            steering = outcome if entry.own_ttft_s is None else served_outcome(ttft_s, tpot_s, cls_bound)
            self.served_total += 1
            if tpot_s is not None and cls_bound is not None and cls_bound.tpot_s > 0:
                self._tpot_shares.append((self.served_total, tpot_s / cls_bound.tpot_s))
            self.missed_total += steering != "good"
            self.queued_missed_total += steering == "ttft_missed" and entry.before_engine_s > engine_ttft_s
        self.ended(entry.cls, outcome)
        return outcome

    def answer_tokens(self, min_samples: int = 10) -> float | None:
        """The ``ANSWER_QUANTILE`` (10th percentile) of the output tokens of the last
        ``ANSWER_SAMPLES`` requests served: what the slo policy shares a prefill chunk's step over
        (vLLM's TPOT is a request's mean over its answer); or, where lower, that of the
        ``max_tokens`` the last ``ASKED_RECENT`` requests started asked for (an answer is at most
        that long, and a change of load shows there at once: the served answers of a chat phase
        sized the budget for the first 30 s of a code phase, whose answers of 6-14 tokens then
        missed their TPOT). Until ``min_samples`` are served, the asked alone (at a start, a
        budget sized for a one-token answer would prefill each prompt over many steps, and the
        first requests would miss their TTFT); None before either."""
        asked = list(self._asked)[-ASKED_RECENT:]
        bound = percentile(asked, ANSWER_QUANTILE, "nearest_rank") if asked else None
        if len(self._answers) < min_samples:
            return bound
        served = percentile(list(self._answers), ANSWER_QUANTILE, "nearest_rank")
        return min((x for x in (served, bound) if x is not None), default=None)

    def tpot_shares(self) -> tuple[tuple[int, float], ...]:
        """(``served_total`` when served, TPOT over its class's bound) of the last ``TPOT_SHARES``
        requests served with a TPOT: how near the bound the served requests' pace ran, which the slo
        policy raises its margin by (a count of misses says only that none passed it)."""
        return tuple(self._tpot_shares)

    def asked_prefill_per_decode(self) -> float | None:
        """Prompt tokens per output token the last requests started asked for (their sums): the
        load's prefill mix as an upper bound, every prompt token counted as prefilled (the prefix
        cache's hits are known only from the engine's steps). None before any said both."""
        if not self._asked_mix:
            return None
        return sum(p for p, _ in self._asked_mix) / sum(m for _, m in self._asked_mix)

    def ended(self, cls: str, outcome: str, steers: bool = True) -> None:
        """Count one request of ``cls`` that ended with ``outcome`` (one of ``OUTCOMES``); a refusal
        counts in ``refused_total`` where it ``steers`` (not one by the request's own bound)."""
        self._count(cls, outcome)
        self.refused_total += outcome == "refused" and steers
        now = self._clock()
        self._ended.append((now, cls, outcome))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._ended and self._ended[0][0] <= now - self.window_s:
            self._ended.popleft()

    def state(self) -> dict[str, Any]:
        """/state's ``outcomes``: over the last ``window_s``, good requests per second (goodput), the
        share of the requests that ended that were good (SLO attainment), and the counts by class."""
        now = self._clock()
        self._trim(now)
        by_class: dict[str, dict[str, int]] = {}
        for _, cls, outcome in self._ended:
            counts = by_class.setdefault(cls, dict.fromkeys(OUTCOMES, 0))
            counts[outcome] += 1
        good = sum(c["good"] for c in by_class.values())
        ended = len(self._ended)
        return {
            "window_s": self.window_s,
            "goodput_rps": good / self.window_s,
            "attainment": good / ended if ended else None,
            "by_class": by_class,
            "unmatched": self.unmatched,
        }


class GateOutcomes:
    """The gate's events (``admission/classes.GateEvents``) with each refusal counted in ``ledger``:
    an early refusal or a shed waiter as ``refusal_outcome`` says (a 429 ``refused``, a 503
    ``failed``), a queue deadline passed as ``refused``; every event then goes on to ``then`` (the
    daemon's metrics, ``admin/metrics.GateMetrics``)."""

    def __init__(self, ledger: OutcomeLedger, then: GateEvents | None = None) -> None:
        self.ledger = ledger
        self.then: GateEvents = then or NoEvents()

    def admitted(self, cls: str, wait_s: float) -> None:
        self.then.admitted(cls, wait_s)

    def rejected(self, cls: str, reason: str) -> None:
        # a refusal by the request's own header bound steers nothing: a client cannot push every
        # other client's margin up by asking the impossible either
        self.ledger.ended(cls, refusal_outcome(reason), steers=reason != OWN_BOUND)
        self.then.rejected(cls, reason)

    def timed_out(self, cls: str, wait_s: float) -> None:
        self.ledger.ended(cls, "refused")
        self.then.timed_out(cls, wait_s)
