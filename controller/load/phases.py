"""The phase-changing load (``--workload phases``) and its per-phase figures.

Three phases of seeded open-loop Poisson arrivals, outputs forced to length:

1. ``interactive_burst``: many short requests (priority 0);
2. ``long_batch``: long requests (priority 1), more than the engine serves within the SLOs;
3. ``mixed``: both at once.

``bench compare --workload phases`` replays the same schedule against every server and writes ``phases.md``:
per phase, goodput (requests that *arrived* in the phase, by their send time, and met both SLOs, over the
phase's length; refused and failed requests are misses, so shedding cannot game it), p99 TTFT and the
preemptions counted between the phase's first and last second (the last phase runs to the end of the
run: its requests finish after its arrivals stop), with the ceiling (every arrival good) and goodput
ratios to the best static server.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controller.load.workload import RequestSpec
from controller.results.records import RequestRecord, SeriesPoint, meets_slo, percentile
from controller.results.tables import best_static, cell

PROMPT_TOKENS = 40


@dataclass(frozen=True)
class Stream:
    rate_per_s: float
    max_tokens: int
    priority: int


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    streams: tuple[Stream, ...]


PHASES = (
    Phase("interactive_burst", 20.0, (Stream(16.0, 32, 0),)),
    Phase("long_batch", 40.0, (Stream(5.0, 400, 1),)),
    Phase("mixed", 40.0, (Stream(6.0, 32, 0), Stream(3.0, 400, 1))),
)
OVERALL = "overall"


def schedule(seed: int, prompt_tokens: int = PROMPT_TOKENS) -> list[RequestSpec]:
    """The same Poisson arrivals for every server, in time order."""
    rng = random.Random(seed)
    out: list[tuple[float, Stream]] = []
    start = 0.0
    for phase in PHASES:
        for stream in phase.streams:
            t = start + rng.expovariate(stream.rate_per_s)
            while t < start + phase.duration_s:
                out.append((t, stream))
                t += rng.expovariate(stream.rate_per_s)
        start += phase.duration_s
    out.sort(key=lambda a: a[0])
    return [RequestSpec(i, t, prompt_tokens, s.max_tokens, s.priority) for i, (t, s) in enumerate(out)]


def phase_bounds() -> list[tuple[str, float, float]]:
    out, t = [], 0.0
    for phase in PHASES:
        out.append((phase.name, t, t + phase.duration_s))
        t += phase.duration_s
    return out


def preemptions_between(series: Sequence[SeriesPoint], t_from: float, t_to: float) -> float:
    """Preemptions counted between the samples nearest ``t_from`` and ``t_to`` (the last at or before)."""
    points = [(p.t_s, p.preemptions) for p in series if p.preemptions is not None]
    if not points:
        return 0.0

    def at(t: float) -> float:
        before = [n for t_s, n in points if t_s <= t]
        return float(before[-1] if before else points[0][1])

    return at(t_to) - at(t_from)


def summarize(
    records: Sequence[RequestRecord],
    series: Sequence[SeriesPoint],
    slo_ttft_s: float | None,
    slo_tpot_s: float | None,
) -> dict[str, dict[str, Any]]:
    """Per phase and overall: requests, failed, ceiling and goodput (req/s), p99 TTFT/TPOT, preemptions."""
    bounds = phase_bounds()
    total_s = bounds[-1][2]
    out: dict[str, dict[str, Any]] = {}
    for name, t_from, t_to in [*bounds, (OVERALL, 0.0, total_s)]:
        last = name in (bounds[-1][0], OVERALL)
        mine = [
            r
            for r in records
            if name == OVERALL or t_from <= r.arrival_s < t_to or (last and r.arrival_s >= t_to)
        ]
        ok = [r for r in mine if r.status == "ok"]
        out[name] = {
            "requests": len(mine),
            "failed": sum(r.status != "ok" for r in mine),
            "ceiling_rps": len(mine) / (t_to - t_from),
            "goodput_rps": sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in mine) / (t_to - t_from),
            "ttft_p99_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 99),
            "tpot_p99_s": percentile([r.tpot_s for r in ok if r.tpot_s is not None], 99),
            "preemptions": preemptions_between(series, t_from, float("inf") if last else t_to),
        }
    return out


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """Two markdown tables: figures per phase, and goodput ratios to the best static server."""
    names = [*(p.name for p in PHASES), OVERALL]
    head = ["server", *(f"{p} {m}" for p in names for m in ("goodput/s", "p99 TTFT s", "preempt"))]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    any_res = next(iter(results.values()))
    ceiling = [f"{any_res[p]['ceiling_rps']:.2f}" if i == 0 else "" for p in names for i in range(3)]
    lines.append("| ceiling (every arrival good) | " + " | ".join(ceiling) + " |")
    for name, res in results.items():
        cells = [
            f"{res[p]['goodput_rps']:.2f} | {cell(res[p]['ttft_p99_s'], '.2f')} | {res[p]['preemptions']:.0f}"
            for p in names
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ref = best_static(
        [
            {"target": k, "goodput_rps": v[OVERALL]["goodput_rps"], "throughput_tok_s": 0.0}
            for k, v in results.items()
        ]
    )
    if ref is None:
        return "\n".join(lines)
    best = str(ref["target"])
    lines += ["", f"| goodput / {best} | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    rows = [("ceiling", {p: {"goodput_rps": any_res[p]["ceiling_rps"]} for p in names})]
    for name, res in [*rows, *((k, v) for k, v in results.items() if k != best)]:
        base = [results[best][p]["goodput_rps"] for p in names]
        ratios = [
            f"{res[p]['goodput_rps'] / b:.2f}x" if b else "n/a" for p, b in zip(names, base, strict=True)
        ]
        lines.append(f"| {name} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)
