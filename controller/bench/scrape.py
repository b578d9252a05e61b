"""Server-side time series of a run: ``/metrics`` (any vLLM server) and ``/state`` (our daemon) once a period.

``parse_vllm`` and ``PreemptionCounter`` are pure; :class:`Scraper` is the background task that polls and
builds :class:`SeriesPoint` rows stamped relative to the run's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.results.records import SeriesPoint

# Sample names as exposed by vLLM 0.32 (the KV gauge was vllm:gpu_cache_usage_perc before 0.10).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
RESTARTS = "autopilot_engine_restarts_total"


def parse_vllm(text: str) -> dict[str, float]:
    """The engine figures of a Prometheus text page, each summed over its label sets (engines, models).

    Keys: ``kv_usage`` (the max over label sets, it is a fraction), ``running``, ``waiting``, ``preemptions``,
    ``restarts``; a key is absent when the page lacks the metric.
    """
    sums: dict[str, float] = {}
    kv: list[float] = []
    names = {RUNNING: "running", WAITING: "waiting", PREEMPTIONS: "preemptions", RESTARTS: "restarts"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in KV_USAGE:
                kv.append(float(sample.value))
            elif sample.name in names:
                key = names[sample.name]
                sums[key] = sums.get(key, 0.0) + float(sample.value)
    if kv:
        sums["kv_usage"] = max(kv)
    return sums


@dataclass
class PreemptionCounter:
    """Preemptions since the first reading, across counter resets (a new engine restarts vLLM's counters)."""

    first: float | None = None
    last: float = 0.0
    offset: float = 0.0

    def update(self, value: float) -> int:
        if self.first is None:
            self.first = self.last = value
        if value < self.last:  # reset: what the old counter had counted stays counted
            self.offset += self.last
        self.last = value
        return round(self.offset + value - self.first)


def state_fields(state: dict[str, Any]) -> dict[str, int | None]:
    """Knobs and gate queue of our daemon's ``/state``."""
    gate = state.get("gate") or {}
    return {
        "admission_limit": state.get("admission_limit"),
        "batch_cap": state.get("batch_cap"),
        "token_budget": state.get("token_budget"),
        "queue_depth": gate.get("queue_depth"),
    }


@dataclass
class Scraper:
    """Polls ``metrics_url`` (and ``state_url`` when given) every ``period_s`` until stopped."""

    metrics_url: str | None
    state_url: str | None = None
    period_s: float = 1.0
    points: list[SeriesPoint] = field(default_factory=list)
    restarts_first: float | None = None
    """The first ``autopilot_engine_restarts_total`` seen (our daemon only)."""
    restarts: float | None = None
    """The last one seen."""
    errors: int = 0
    probe: Callable[[], dict[str, int | None]] | None = None
    """Extra per-sample fields (``rss_bytes``, ``gpu_mem_bytes``) from the memory probe, when any."""
    _preempt: PreemptionCounter = field(default_factory=PreemptionCounter)
    _task: asyncio.Task[None] | None = None

    async def _get(self, session: aiohttp.ClientSession, url: str, as_json: bool) -> Any:
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    self.errors += 1
                    return None
                return await (resp.json() if as_json else resp.text())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            self.errors += 1
            return None

    async def sample(self, session: aiohttp.ClientSession, t_s: float) -> SeriesPoint:
        values: dict[str, Any] = {}
        if self.metrics_url:
            text = await self._get(session, self.metrics_url, as_json=False)
            vllm = parse_vllm(text) if text else {}
            values["kv_usage"] = vllm.get("kv_usage")
            values["running"] = _int(vllm.get("running"))
            values["waiting"] = _int(vllm.get("waiting"))
            if "preemptions" in vllm:
                values["preemptions"] = self._preempt.update(vllm["preemptions"])
            if "restarts" in vllm:
                self.restarts = vllm["restarts"]
                if self.restarts_first is None:
                    self.restarts_first = self.restarts
        if self.state_url:
            state = await self._get(session, self.state_url, as_json=True)
            if isinstance(state, dict):
                values.update(state_fields(state))
        if self.probe is not None:
            values.update(self.probe())
        return SeriesPoint(t_s=t_s, **values)

    async def _loop(self, run_start: float) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.period_s * 2))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                due = run_start + (len(self.points) + 1) * self.period_s
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                self.points.append(await self.sample(session, time.monotonic() - run_start))

    def start(self, run_start: float) -> None:
        self._task = asyncio.create_task(self._loop(run_start))

    async def stop(self) -> list[SeriesPoint]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.points


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)
