"""bench report over run directories written the way bench run (and the twin) write them."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.results.records import (
    RequestRecord,
    SeriesPoint,
    client_series,
    merge_series,
    summarize,
    write_run,
)
from controller.results.report import find_runs, render


def _write(dir: Path, target: str, knobs: bool, delay: float) -> None:
    records = [
        RequestRecord(i, 0, 10, 5, 5, 0.5 * i, "ok", 200, 0.1 + delay, 0.01, 0.14 + delay, (0.01,) * 4)
        for i in range(10)
    ]
    server = [
        SeriesPoint(t_s=float(t), kv_usage=0.1 * t, running=t, waiting=1, preemptions=0,
                    admission_limit=8 if knobs else None, batch_cap=4 if knobs else None,
                    queue_depth=2 if knobs else None)
        for t in range(1, 6)
    ]  # fmt: skip
    series = merge_series(server, client_series(records, 5.0))
    write_run(dir, records, series, summarize(records, 5.0, 0.5, 0.05, series, extra={"target": target}))


def test_report_renders_pngs_and_markdown(tmp_path: Path) -> None:
    _write(tmp_path / "runs" / "a", "vllm-serve", knobs=False, delay=0.0)
    _write(tmp_path / "runs" / "b", "policy:pid", knobs=True, delay=0.6)  # misses the 0.5 s TTFT SLO
    dirs = find_runs([tmp_path / "runs"])
    assert [d.name for d in dirs] == ["a", "b"]
    report = render(tmp_path / "report", dirs, title="t")
    text = report.read_text()
    for png in ("throughput_latency.png", "goodput.png", "knobs_kv.png", "ttft_queue.png"):
        assert f"]({png})" in text
        assert (tmp_path / "report" / png).stat().st_size > 5000
    assert "| vllm-serve | 10.0 | 2.00 | 100% |" in text  # 50 tokens over 5 s, 10 requests met the SLO
    assert "| policy:pid | 10.0 | 0.00 | 0% |" in text


def test_find_runs_names_a_directory_without_runs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no summary\.json"):
        find_runs([tmp_path])
