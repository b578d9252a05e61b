"""One benchmark run against one live server: warm up, send the workload, scrape, write the run directory.

The run directory holds ``records.jsonl``, ``timeseries.jsonl`` and ``summary.json`` (see
``controller/results/records.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.bench.scrape import Scraper
from controller.load.client import Target, run_open_loop
from controller.load.prompts import PromptBuilder
from controller.load.workload import RequestSpec, describe
from controller.results.records import (
    RequestRecord,
    client_series,
    merge_series,
    summarize,
    write_run,
)


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


def add_slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slo-ttft",
        type=float,
        help="TTFT objective in seconds (goodput counts requests within it; with --slo-tpot, the "
        "daemon's [slo] when --config has none)",
    )
    p.add_argument(
        "--slo-tpot",
        type=float,
        help="TPOT objective in seconds per output token after the first (as --slo-ttft)",
    )
    p.add_argument(
        "--warmup", type=int, default=4, help="short unrecorded requests before the run (default 4)"
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_config(args: argparse.Namespace, out: Path) -> RunConfig:
    """The run settings the SLO options describe, writing into ``out``."""
    return RunConfig(
        out=out,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
        warmup=args.warmup,
        timeout_s=args.request_timeout,
        progress=not args.no_progress,
        concurrency=args.concurrency,
    )
