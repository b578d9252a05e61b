"""The metric math of the bench toolkit, on hand-computed cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.results.records import (
    RequestRecord,
    SeriesPoint,
    client_series,
    goodput,
    meets_slo,
    merge_series,
    percentile,
    read_records,
    read_series,
    summarize,
    tpot,
    write_jsonl,
)


def rec(
    index: int,
    *,
    status: str = "ok",
    ttft: float | None = 0.1,
    tpot_s: float | None = 0.01,
    out: int = 10,
    arrival: float = 0.0,
    e2e: float | None = None,
    prio: int = 0,
) -> RequestRecord:
    if e2e is None and ttft is not None and tpot_s is not None:
        e2e = ttft + tpot_s * (out - 1)
    return RequestRecord(
        index=index,
        priority=prio,
        prompt_tokens=5,
        output_tokens_requested=out,
        output_tokens=out if status == "ok" else 0,
        arrival_s=arrival,
        status=status,  # type: ignore[arg-type]
        http_status={"ok": 200, "refused": 429, "failed": 500}[status],
        ttft_s=ttft if status == "ok" else None,
        tpot_s=tpot_s if status == "ok" else None,
        e2e_s=e2e,
    )


def test_percentile_interpolates_between_ranks() -> None:
    # ranks of [1, 2, 3, 4]: p50 sits halfway between 2 and 3; p99 at rank 2.97 -> 3 + 0.97 * 1
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


def test_tpot_excludes_the_first_token() -> None:
    # 1.0 s to first token, 2.0 s end to end, 11 tokens: 10 gaps of 0.1 s
    assert tpot(1.0, 2.0, 11) == pytest.approx(0.1)
    assert tpot(1.0, 1.0, 1) is None
    assert tpot(1.0, 1.5, 0) is None


def test_slo_accounting_counts_refused_and_failed_as_misses() -> None:
    records = [
        rec(0, ttft=0.1, tpot_s=0.01),  # meets both
        rec(1, ttft=0.6, tpot_s=0.01),  # TTFT over 0.5
        rec(2, ttft=0.1, tpot_s=0.03),  # TPOT over 0.02
        rec(3, ttft=0.5, tpot_s=0.02),  # exactly on both limits: meets
        rec(4, status="refused", e2e=0.001),
        rec(5, status="failed", e2e=0.2),
        rec(6, ttft=0.2, tpot_s=None, out=1, e2e=0.2),  # one token: no TPOT, TTFT decides
    ]
    met = [meets_slo(r, 0.5, 0.02) for r in records]
    assert met == [True, False, False, True, False, False, True]
    # 3 of 7 met over 2 s
    assert goodput(records, 2.0, 0.5, 0.02) == pytest.approx(1.5)
    # no SLO: every completed request counts, refused/failed still do not
    assert goodput(records, 1.0, None, None) == pytest.approx(5.0)
    assert goodput(records, 0.0, 0.5, 0.02) == 0.0


def test_shedding_cannot_raise_goodput() -> None:
    served = [rec(i, ttft=0.4) for i in range(4)]  # all meet a 0.5 s TTFT SLO
    shed = [*served[:2], rec(2, status="refused", e2e=0.0), rec(3, status="refused", e2e=0.0)]
    assert goodput(shed, 1.0, 0.5, None) < goodput(served, 1.0, 0.5, None)
    assert summarize(shed, 1.0, 0.5, None)["slo_attainment"] == pytest.approx(0.5)


def test_summary_keys_and_values() -> None:
    records = [
        rec(0, ttft=0.1, tpot_s=0.01, out=11, prio=0),
        rec(1, ttft=0.3, tpot_s=0.02, out=11, prio=1),
        rec(2, status="refused", e2e=0.0, prio=1),
    ]
    series = [
        SeriesPoint(t_s=1.0, kv_usage=0.2, preemptions=0, queue_depth=1),
        SeriesPoint(t_s=2.0, kv_usage=0.6, preemptions=3, queue_depth=4),
        SeriesPoint(t_s=3.0, kv_usage=None),
    ]
    s = summarize(records, 2.0, 0.2, 0.05, series, extra={"target": "x"})
    assert s["requests"] == 3 and s["ok"] == 2 and s["refused"] == 1 and s["failed"] == 0
    assert s["output_tokens"] == 22
    assert s["throughput_tok_s"] == pytest.approx(11.0)
    assert s["goodput_rps"] == pytest.approx(0.5)  # only request 0 meets TTFT <= 0.2
    assert s["ttft_p50"] == pytest.approx(0.2)
    assert s["ttft_p99"] == pytest.approx(0.1 + 0.99 * 0.2)
    assert s["tpot_p50"] == pytest.approx(0.015)
    assert s["tpot_p99"] == pytest.approx(0.01 + 0.99 * 0.01)
    assert s["ttft_max"] == pytest.approx(0.3)  # the refused request has no TTFT
    assert s["itl_max"] is None  # these records carry no inter-token gaps
    assert s["kv_usage_mean"] == pytest.approx(0.4)
    assert s["kv_usage_max"] == pytest.approx(0.6)
    assert s["preemptions"] == 3
    assert s["queue_depth_max"] == 4
    assert s["target"] == "x"
    assert s["by_priority"]["1"] == {
        "requests": 2,
        "refused": 1,
        "failed": 0,
        "goodput_rps": 0.0,
        "ttft_p50": pytest.approx(0.3),
        "ttft_p99": pytest.approx(0.3),
        "tpot_p99": pytest.approx(0.02),
    }
    json.dumps(s, allow_nan=False)  # valid JSON: no NaN anywhere


def test_itl_max_is_the_longest_gap_of_any_served_stream() -> None:
    records = [rec(0), rec(1), rec(2, status="failed", e2e=1.0)]
    records[0] = RequestRecord(**{**records[0].__dict__, "itl_s": (0.01, 0.25, 0.02)})
    records[1] = RequestRecord(**{**records[1].__dict__, "itl_s": (0.03,)})
    records[2] = RequestRecord(**{**records[2].__dict__, "itl_s": (9.0,)})  # a failed stream is not served
    assert summarize(records, 1.0, None, None)["itl_max"] == pytest.approx(0.25)


def test_throughput_is_the_served_tokens_over_the_duration() -> None:
    records = [rec(0, out=100), rec(1, out=100), rec(2, status="failed", out=100, e2e=1.0)]
    s = summarize(records, 4.0, None, None)
    assert (s["requests"], s["failed"], s["output_tokens"]) == (3, 1, 200)  # the failed one's count none
    assert s["throughput_tok_s"] == pytest.approx(50.0)
    assert summarize(records, 0.0, None, None)["throughput_tok_s"] == 0.0  # no duration: no rate


def test_empty_run_summarizes_to_nulls() -> None:
    s = summarize([], 10.0, 1.0, 0.1)
    assert s["requests"] == 0 and s["goodput_rps"] == 0.0 and s["throughput_tok_s"] == 0.0
    assert s["ttft_p99"] is None and s["ttft_max"] is None and s["itl_max"] is None
    assert s["kv_usage_mean"] is None and s["preemptions"] is None
    json.dumps(s, allow_nan=False)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    records = [rec(0), rec(1, status="failed", e2e=0.3)]
    records[0] = RequestRecord(**{**records[0].__dict__, "itl_s": (0.01, 0.02)})
    write_jsonl(tmp_path / "records.jsonl", records)
    assert read_records(tmp_path / "records.jsonl") == records
    series = [SeriesPoint(t_s=1.0, admission_limit=8, batch_cap=4, kv_usage=0.5)]
    write_jsonl(tmp_path / "timeseries.jsonl", series)
    assert read_series(tmp_path / "timeseries.jsonl") == series


def test_read_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec(0).to_json()) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"records.jsonl:2: not JSON"):
        read_records(path)
    path.write_text('{"t_s": 1.0, "colour": "red"}\n')
    with pytest.raises(ValueError, match=r":1: unknown field\(s\) \['colour'\]"):
        read_series(path)
    with pytest.raises(ValueError, match="status='lost'"):
        RequestRecord(0, 0, 1, 1, 1, 0.0, "lost")  # type: ignore[arg-type]


def test_client_series_bins_ttft_in_flight_and_tokens() -> None:
    # request A: sent at 0.2, first token at 0.7, ends at 2.7 with 20 tokens -> 10 tok/s over (0.7, 2.7]
    # request B: sent at 1.5, first token at 1.9, ends at 1.9 with 1 token
    a = rec(0, arrival=0.2, ttft=0.5, tpot_s=None, out=20, e2e=2.5)
    b = rec(1, arrival=1.5, ttft=0.4, tpot_s=None, out=1, e2e=0.4)
    pts = client_series([a, b], duration_s=3.0)
    assert [p.t_s for p in pts] == [1.0, 2.0, 3.0]
    assert [p.in_flight for p in pts] == [1, 1, 0]  # B is done by t=2; A by t=3
    assert pts[0].ttft_p50_s == pytest.approx(0.5)
    assert pts[1].ttft_p50_s == pytest.approx(0.4)
    assert pts[2].ttft_p50_s is None
    assert [p.output_tok_s for p in pts] == pytest.approx([3.0, 10.0 + 1.0, 7.0])
    server = [SeriesPoint(t_s=1.5, kv_usage=0.3), SeriesPoint(t_s=2.5, kv_usage=0.4)]
    merged = merge_series(server, pts)
    assert merged[0].kv_usage == 0.3 and merged[0].ttft_p50_s == pytest.approx(0.4)
    assert merged[1].output_tok_s == pytest.approx(7.0)
