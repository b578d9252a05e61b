"""bench/loadgen.py: the percentile and throughput math, and SSE parsing (no servers)."""

from __future__ import annotations

import math

import pytest

from bench.loadgen import (
    RequestResult,
    make_prompt,
    percentile,
    summarize,
    tokens_per_second,
)
from controller.bench.client import parse_event


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # order does not matter
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97 between 3 and 4


def test_percentile_edge_cases() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tokens_per_second() -> None:
    assert tokens_per_second(1000, 2.0) == 500.0
    assert tokens_per_second(1000, 0.0) == 0.0


def test_summarize_counts_only_successful_requests() -> None:
    results = [
        RequestResult(ok=True, ttft_s=0.010, output_tokens=100, prompt_tokens=40),
        RequestResult(ok=True, ttft_s=0.030, output_tokens=100, prompt_tokens=42),
        RequestResult(ok=False, error="HTTP 500: boom"),
    ]
    stats = summarize(results, duration_s=4.0)
    assert stats.requests == 3
    assert stats.failed == 1
    assert stats.output_tokens == 200
    assert stats.tokens_per_s == pytest.approx(50.0)
    assert stats.ttft_p50_ms == pytest.approx(20.0)
    assert stats.ttft_p99_ms == pytest.approx(29.8)
    assert stats.mean_prompt_tokens == pytest.approx(41.0)
    assert stats.first_error == "HTTP 500: boom"


def test_summarize_empty_phase() -> None:
    stats = summarize([], duration_s=1.0)
    assert stats.requests == 0
    assert stats.tokens_per_s == 0.0
    assert math.isnan(stats.ttft_p99_ms)


def testparse_event() -> None:
    assert parse_event(b'data: {"choices": [{"text": "a"}]}\n') == {"choices": [{"text": "a"}]}
    assert parse_event(b"data: [DONE]\n") is None
    assert parse_event(b"\n") is None


def test_make_prompt_is_deterministic_and_varies() -> None:
    assert make_prompt(3) == make_prompt(3)
    assert make_prompt(3) != make_prompt(4)
    assert len(make_prompt(0, words=40).split()) == 40
