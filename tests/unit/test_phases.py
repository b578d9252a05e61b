"""controller/load/phases.py (moved from the tests of bench/phases.py): the schedule, SLO accounting,
per-phase preemptions and the per-phase table of ``bench compare --workload phases`` (no servers).

The script's /metrics parser is gone (the runner's scraper reads preemptions into the time series,
test_bench_scrape.py); its refusal of result files of other settings is ``compare.same_workload``.
"""

from __future__ import annotations

import pytest

from controller.bench.experiments import compare
from controller.load import phases
from controller.results.records import RequestRecord, SeriesPoint, tpot


def rec(t_s: float, ttft: float | None, latency: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        index=0, priority=0, prompt_tokens=40, output_tokens_requested=tokens, output_tokens=tokens,
        arrival_s=t_s, status="ok" if ok else "failed", ttft_s=ttft, e2e_s=latency,
        tpot_s=tpot(ttft, latency, tokens) if ok and ttft is not None else None,
    )  # fmt: skip


def test_schedule_is_seeded_and_stays_inside_its_phases() -> None:
    a, b = phases.schedule(0), phases.schedule(0)
    assert a == b and a != phases.schedule(1)
    bounds = phases.phase_bounds()
    for spec in a:
        name, start, end = next(x for x in bounds if x[1] <= spec.arrival_s < x[2])
        stream = next(s for p in phases.PHASES if p.name == name for s in p.streams
                      if (s.max_tokens, s.priority) == (spec.output_tokens, spec.priority))  # fmt: skip
        assert stream and start <= spec.arrival_s < end
    assert [x.arrival_s for x in a] == sorted(x.arrival_s for x in a)
    assert [x.index for x in a] == list(range(len(a)))


@pytest.mark.parametrize(
    ("record", "tpot_s", "good"),
    [
        (rec(0, 0.5, 3.6, 32), 0.1, True),  # (3.6 - 0.5) / 31 = 0.1: on the SLO is good
        (rec(0, 1.01, 1.5, 32), 0.49 / 31, False),  # TTFT over 1 s
        (rec(0, 0.5, 4.0, 32), 3.5 / 31, False),  # TPOT over 0.1 s
        (rec(0, 0.2, 0.2, 1), None, True),  # one token: no inter-token time
        (rec(0, None, 0.0, 0, ok=False), None, False),  # failed or refused: a miss
    ],
)
def test_tpot_and_good(record: RequestRecord, tpot_s: float | None, good: bool) -> None:
    assert record.tpot_s == (None if tpot_s is None else pytest.approx(tpot_s))
    out = phases.summarize([record], [], 1.0, 0.1)
    assert out[phases.OVERALL]["goodput_rps"] * 100.0 == pytest.approx(1.0 if good else 0.0)


def _series(*points: tuple[float, int]) -> list[SeriesPoint]:
    return [SeriesPoint(t_s=t, preemptions=n) for t, n in points]


def test_preemptions_between_samples() -> None:
    series = _series((0.5, 2), (10.2, 5), (30.0, 9))
    assert phases.preemptions_between(series, 0.0, 10.0) == 0.0  # both ends read the first sample
    assert phases.preemptions_between(series, 0.0, 20.0) == 3.0
    assert phases.preemptions_between(series, 20.0, float("inf")) == 4.0


def test_summarize_counts_goodput_per_phase_over_its_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(phases, "PHASES", (phases.Phase("a", 10.0, ()), phases.Phase("b", 30.0, ())))
    records = [rec(1, 0.1, 0.41, 32), rec(2, 2.0, 3.0, 32), rec(12, 0.3, 0.3, 1)]
    out = phases.summarize(records, _series((0.0, 0), (11.0, 4), (50.0, 6)), 1.0, 0.1)
    assert out["a"]["goodput_rps"] == pytest.approx(0.1)  # 1 good in 10 s
    assert out["a"]["ceiling_rps"] == pytest.approx(0.2)
    assert out["b"]["goodput_rps"] == pytest.approx(1 / 30)
    assert out["overall"]["goodput_rps"] == pytest.approx(2 / 40)
    assert (out["a"]["preemptions"], out["b"]["preemptions"], out["overall"]["preemptions"]) == (
        0.0,
        6.0,
        6.0,
    )
    assert out["a"]["ttft_p99_s"] == pytest.approx(0.1 + 0.99 * 1.9)


def summary(goodputs: list[float]) -> dict[str, dict[str, float]]:
    names = [*(p.name for p in phases.PHASES), "overall"]
    fixed = {"ceiling_rps": 10.0, "ttft_p99_s": 0.5, "tpot_p99_s": 0.01, "preemptions": 0}
    return {n: {"goodput_rps": g, **fixed} for n, g in zip(names, goodputs, strict=True)}


def test_report_ratios_against_the_best_static_preset() -> None:
    text = phases.markdown(
        {
            "static:a": summary([8.0, 4.0, 8.0, 6.0]),
            "static:b": summary([8.0, 5.0, 6.0, 5.0]),
            "pid": summary([8.0, 5.0, 8.8, 6.6]),
        }
    )
    assert "| goodput / static:a |" in text  # the best static preset by overall goodput
    assert "| pid | 1.00x | 1.25x | 1.10x | 1.10x |" in text
    assert "| ceiling | 1.25x | 2.50x | 1.25x | 1.67x |" in text


def test_markdown_tables() -> None:
    text = phases.markdown({"static:a": summary([8.0, 4.0, 8.0, 6.0]), "pid": summary([8.0, 5.0, 8.8, 6.6])})
    row = "| static:a | 8.00 | 0.50 | 0 | 4.00 | 0.50 | 0 | 8.00 | 0.50 | 0 | 6.00 | 0.50 | 0 |"
    assert row in text
    assert "| pid | 1.00x | 1.25x | 1.10x | 1.10x |" in text
    assert "| ceiling | 1.25x | 2.50x | 1.25x | 1.67x |" in text


def test_results_of_other_settings_are_refused() -> None:
    slo = {"slo_ttft_s": 1.0, "slo_tpot_s": 0.1}
    runs = [{"target": "static:a", "workload": {"requests": 10}, **slo},
            {"target": "pid", "workload": {"requests": 11}, **slo}]  # fmt: skip
    compare.same_workload(runs[:1])
    with pytest.raises(ValueError, match="measured on another workload"):
        compare.same_workload(runs)
