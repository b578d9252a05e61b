"""bench/phases.py: the schedule, SLO accounting, per-phase preemptions and the report (no servers)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import phases


def rec(
    t_s: float, phase: str, ttft: float | None, latency: float, tokens: int, ok: bool = True
) -> dict[str, Any]:
    return {"t_s": t_s, "phase": phase, "priority": 0, "ok": ok, "ttft_s": ttft, "latency_s": latency,
            "output_tokens": tokens, "prompt_tokens": 40, "error": None}  # fmt: skip


def test_schedule_is_seeded_and_stays_inside_its_phases() -> None:
    a, b = phases.schedule(0), phases.schedule(0)
    assert a == b and a != phases.schedule(1)
    for name, start, end in phases.phase_bounds():
        assert all(start <= x.t_s < end for x in a if x.phase == name)
    assert [x.t_s for x in a] == sorted(x.t_s for x in a)


@pytest.mark.parametrize(
    ("record", "tpot", "good"),
    [
        (rec(0, "p", 0.5, 3.6, 32), 0.1, True),  # (3.6 - 0.5) / 31 = 0.1: on the SLO is good
        (rec(0, "p", 1.01, 1.5, 32), 0.49 / 31, False),  # TTFT over 1 s
        (rec(0, "p", 0.5, 4.0, 32), 3.5 / 31, False),  # TPOT over 0.1 s
        (rec(0, "p", 0.2, 0.2, 1), 0.0, True),  # one token: no inter-token time
        (rec(0, "p", None, 0.0, 0, ok=False), None, False),  # failed or refused: a miss
    ],
)
def test_tpot_and_good(record: dict[str, Any], tpot: float | None, good: bool) -> None:
    assert phases.tpot(record) == (None if tpot is None else pytest.approx(tpot))
    assert phases.good(record, 1.0, 0.1) is good


def test_parse_metrics_sums_label_sets() -> None:
    text = "\n".join(
        [
            'vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0',
            'vllm:num_preemptions_total{engine="1",model_name="tiny"} 2.0',
            "autopilot_batch_cap 64.0",
            'autopilot_queue_depth{priority_class="0"} 2.0',
            'autopilot_queue_depth{priority_class="1"} 5.0',
        ]
    )
    out = phases.parse_metrics(text)
    assert (out["preemptions"], out["batch_cap"], out["gate_queue"]) == (5.0, 64.0, 7.0)
    assert math.isnan(out["kv_usage"])


def test_preemptions_between_scrapes() -> None:
    scrapes = [
        {"t_s": 0.5, "preemptions": 2.0},
        {"t_s": 10.2, "preemptions": 5.0},
        {"t_s": 30.0, "preemptions": 9.0},
    ]
    assert phases.preemptions_between(scrapes, 0.0, 10.0) == 0.0  # both ends read the first scrape
    assert phases.preemptions_between(scrapes, 0.0, 20.0) == 3.0
    assert phases.preemptions_between(scrapes, 20.0, float("inf")) == 4.0


def test_summarize_counts_goodput_per_phase_over_its_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(phases, "PHASES", (phases.Phase("a", 10.0, ()), phases.Phase("b", 30.0, ())))
    records = [rec(1, "a", 0.1, 0.41, 32), rec(2, "a", 2.0, 3.0, 32), rec(12, "b", 0.3, 0.3, 1)]
    scrapes = [(0.0, 0.0), (11.0, 4.0), (50.0, 6.0)]
    run = {"records": records, "scrapes": [{"t_s": t, "preemptions": n} for t, n in scrapes]}
    out = phases.summarize(run, 1.0, 0.1)
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


def summary(goodputs: list[float]) -> dict[str, Any]:
    names = [*(p.name for p in phases.PHASES), "overall"]
    fixed = {"ceiling_rps": 10.0, "ttft_p99_s": 0.5, "tpot_p99_s": 0.01, "preemptions": 0}
    return {n: {"goodput_rps": g, **fixed} for n, g in zip(names, goodputs, strict=True)}


def test_report_ratios_against_the_best_static_preset() -> None:
    text = phases.report(
        {
            "static:a": summary([8.0, 4.0, 8.0, 6.0]),
            "static:b": summary([8.0, 5.0, 6.0, 5.0]),
            "pid": summary([8.0, 5.0, 8.8, 6.6]),
        }
    )
    assert "best static preset (overall goodput): static:a" in text
    assert "pid / static:a: interactive_burst 1.00x, long_batch 1.25x, mixed 1.10x, overall 1.10x" in text
    assert "ceiling / static:a: interactive_burst 1.25x, long_batch 2.50x, mixed 1.25x, overall 1.67x" in text


def test_markdown_tables() -> None:
    text = phases.markdown({"static:a": summary([8.0, 4.0, 8.0, 6.0]), "pid": summary([8.0, 5.0, 8.8, 6.6])})
    row = "| static:a | 8.00 | 0.50 | 0 | 4.00 | 0.50 | 0 | 8.00 | 0.50 | 0 | 6.00 | 0.50 | 0 | nan |"
    assert row in text
    assert "| pid | 1.00x | 1.25x | 1.10x | 1.10x |" in text
    assert "| ceiling | 1.25x | 2.50x | 1.25x | 1.67x |" in text


def test_results_of_other_settings_are_refused(tmp_path: Path) -> None:
    for i, (name, settings) in enumerate([("static:a", {"seed": "0"}), ("pid", {"seed": "1"})]):
        data = {"name": name, "measured_at": float(i), "settings": settings, "summary": {}}
        (tmp_path / f"{i}.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="measured with other settings"):
        phases.load_results(tmp_path)
