"""One benchmark run against one live server: warm up, send the workload, scrape, write the run directory.

The run directory holds ``records.jsonl``, ``timeseries.jsonl`` and ``summary.json`` (see ``records``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.bench.client import Target, run_open_loop
from controller.bench.prompts import PromptBuilder
from controller.bench.records import (
    RequestRecord,
    client_series,
    merge_series,
    summarize,
    write_jsonl,
)
from controller.bench.scrape import Scraper
from controller.bench.workload import RequestSpec, describe

RECORDS = "records.jsonl"
SERIES = "timeseries.jsonl"
SUMMARY = "summary.json"


@dataclass(frozen=True)
class Endpoints:
    """Where the runner reads the server's own figures (None: not scraped)."""

    metrics_url: str | None
    """Prometheus page with ``vllm:*`` (vLLM's ``/metrics``, or our daemon's control plane ``/metrics``)."""
    state_url: str | None = None
    """Our daemon's ``/state`` (admission limit, batch cap, gate queue)."""


@dataclass(frozen=True)
class RunConfig:
    out: Path
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    warmup: int = 4
    """Short unrecorded requests sent before the run, so the first requests do not pay for start-up."""
    timeout_s: float = 600.0
    """Per-request limit; a request over it is recorded as failed."""
    progress: bool = True
    period_s: float = 1.0
    """Time series period."""
    concurrency: int | None = None
    """At most this many requests in flight (``--concurrency``); None: open loop, every arrival on time."""


class _Progress:
    """A tqdm bar over completed requests (silent without tqdm or when disabled)."""

    def __init__(self, total: int, enabled: bool, label: str) -> None:
        self._bar: Any = None
        self.bad = 0
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="req", desc=label, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def done(self, rec: RequestRecord) -> None:
        self.bad += rec.status != "ok"
        if self._bar is not None:
            self._bar.update(1)
            if rec.status != "ok":
                self._bar.set_postfix(not_ok=self.bad)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def warm_up(target: Target, builder: PromptBuilder, count: int, timeout_s: float) -> int:
    """Send ``count`` short requests at once; returns how many failed (the run goes on regardless)."""
    if count <= 0:
        return 0
    specs = [
        RequestSpec(index=-1 - i, arrival_s=0.0, prompt_tokens=16, output_tokens=8) for i in range(count)
    ]
    records = await run_open_loop(
        target,
        specs,
        builder.for_spec,
        run_start=time.monotonic(),
        timeout_s=timeout_s,
    )
    return sum(r.status != "ok" for r in records)


async def run_workload(
    target: Target,
    specs: Sequence[RequestSpec],
    builder: PromptBuilder,
    cfg: RunConfig,
    endpoints: Endpoints,
    *,
    label: str,
    probe: Callable[[], dict[str, int | None]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``specs`` against ``target`` and write the run directory; returns the summary."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    for spec in specs:  # build prompts before the clock starts: tokenizing is not the server's time
        builder.for_spec(spec)
    warm_failed = await warm_up(target, builder, cfg.warmup, cfg.timeout_s)
    scraper = Scraper(endpoints.metrics_url, endpoints.state_url, cfg.period_s, probe=probe)
    progress = _Progress(len(specs), cfg.progress, label)
    run_start = time.monotonic()
    scraper.start(run_start)
    try:
        records = await run_open_loop(
            target,
            specs,
            builder.for_spec,
            run_start=run_start,
            timeout_s=cfg.timeout_s,
            on_done=progress.done,
            concurrency=cfg.concurrency,
        )
    finally:
        progress.close()
        server = await scraper.stop()
    duration = max([r.arrival_s + (r.e2e_s or 0.0) for r in records], default=0.0)
    series = merge_series(server, client_series(records, duration, cfg.period_s))
    if not server:  # no scrape came back (too short a run, or nothing to scrape): keep the client series
        series = client_series(records, duration, cfg.period_s)
    info = {
        "target": label,
        "url": target.base_url,
        "model": target.model,
        "workload": describe(specs),
        "warmup_failed": warm_failed,
        "scrape_errors": scraper.errors,
        "engine_restarts": None
        if scraper.restarts is None
        else scraper.restarts - (scraper.restarts_first or 0),
        **(extra or {}),
    }
    summary = summarize(records, duration, cfg.slo_ttft_s, cfg.slo_tpot_s, series, extra=info)
    write_run(cfg.out, records, series, summary)
    return summary


def write_run(out: Path, records: Sequence[Any], series: Sequence[Any], summary: dict[str, Any]) -> None:
    """The three files of a run directory."""
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / RECORDS, records)
    write_jsonl(out / SERIES, series)
    (out / SUMMARY).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / SUMMARY
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no {SUMMARY}; is this a run directory written by bench run?")
    data: dict[str, Any] = json.loads(path.read_text())
    return data
