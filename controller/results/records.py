"""What a benchmark run leaves behind, and the pure math that folds it into a summary.

A run (``bench run`` against a real server, or ``simulate`` against the twin) writes three files into its
output directory, all read back by ``bench report``:

- ``records.jsonl``: one :class:`RequestRecord` per request, one JSON object per line.
- ``timeseries.jsonl``: one :class:`SeriesPoint` per sampling period (1 s by default).
- ``summary.json``: :func:`summarize` of the two.

All times are seconds relative to the run's start (``*_s``), on the runner's monotonic clock (or the twin's
virtual clock). Percentiles interpolate linearly between ranks (numpy's default method). Empty statistics are
``None`` (JSON ``null``), never NaN, so the files stay valid JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from controller.percentile import percentile

Status = Literal["ok", "refused", "failed"]
STATUSES: tuple[Status, ...] = ("ok", "refused", "failed")
# HTTP statuses that mean "the server refused this request" rather than "it broke".
REFUSED_HTTP = frozenset({429, 503})


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client (or the twin) saw it."""

    index: int
    """Position of the request in the workload (0-based); unique within a run."""
    priority: int
    """vLLM ``priority`` sent with the request (lower is more urgent); 0 when no mix is used."""
    prompt_tokens: int
    """Prompt length in tokens (as counted by the server's usage report when it sent one)."""
    output_tokens_requested: int
    """``max_tokens`` asked for (outputs are forced to this length with ``ignore_eos``)."""
    output_tokens: int
    """Tokens actually received."""
    arrival_s: float
    """When the request was sent, seconds after the run's start."""
    status: Status
    """``ok`` (completed), ``refused`` (HTTP 429/503: the server shed it) or ``failed`` (anything else)."""
    http_status: int | None = None
    """HTTP status of the response; ``None`` when no response came (connection error, timeout)."""
    ttft_s: float | None = None
    """Time to first token: from sending to the first streamed token."""
    tpot_s: float | None = None
    """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``; None below 2 tokens."""
    e2e_s: float | None = None
    """From sending to the end of the response (also set for refused and failed requests)."""
    itl_s: tuple[float, ...] = ()
    """Inter-token latencies (gaps between streamed token chunks); may be empty (the twin leaves it empty)."""
    error: str | None = None
    """Short description of what went wrong, for refused and failed requests."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"RequestRecord.status={self.status!r}: must be one of {STATUSES}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["itl_s"] = [round(x, 6) for x in self.itl_s]
        return data


@dataclass(frozen=True)
class SeriesPoint:
    """One sample of a run's time series. Fields the target cannot report are ``None``.

    Against plain ``vllm serve`` only the engine fields are known; against our daemon ``/state`` adds the
    knobs; the twin knows everything.
    """

    t_s: float
    """Seconds after the run's start."""
    admission_limit: int | None = None
    """The gate's admission limit (our daemon/twin only)."""
    batch_cap: int | None = None
    """The engine's runtime batch cap (our daemon/twin only)."""
    token_budget: int | None = None
    """The engine's per-step token budget in force (our daemon/twin only)."""
    kv_usage: float | None = None
    """KV cache usage, 0..1 (``vllm:kv_cache_usage_perc``)."""
    running: int | None = None
    """Requests running in the engine (``vllm:num_requests_running``)."""
    waiting: int | None = None
    """Requests waiting inside the engine (``vllm:num_requests_waiting``)."""
    queue_depth: int | None = None
    """Requests waiting in our admission gate (our daemon/twin only)."""
    preemptions: int | None = None
    """Preemptions since the run started (cumulative)."""
    in_flight: int | None = None
    """Requests the client has sent and not yet seen finish."""
    ttft_p50_s: float | None = None
    """Median TTFT of the requests whose first token arrived in the period ending at ``t_s``."""
    output_tok_s: float | None = None
    """Output tokens per second received over the period ending at ``t_s``."""
    rss_bytes: int | None = None
    """Resident memory of the server's process tree (when the runner started the server or knows its pid)."""
    gpu_mem_bytes: int | None = None
    """GPU memory in use (NVML, all devices), when NVML is available."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- JSON lines --------------------------------------------------------------------------------------------

_T = TypeVar("_T", RequestRecord, SeriesPoint)


def write_jsonl(path: Path, rows: Iterable[RequestRecord | SeriesPoint]) -> None:
    """Write one JSON object per row (replacing the file)."""
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row.to_json(), separators=(",", ":")) + "\n")


def _from_dict(cls: type[_T], data: dict[str, Any], where: str) -> _T:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown} for {cls.__name__}")
    if cls is RequestRecord and "itl_s" in data:
        data = {**data, "itl_s": tuple(data["itl_s"])}
    try:
        return cls(**data)
    except TypeError as exc:  # missing required fields
        raise ValueError(f"{where}: {exc}") from exc


def _read_jsonl(path: Path, cls: type[_T]) -> list[_T]:
    rows: list[_T] = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from exc
            rows.append(_from_dict(cls, data, where))
    return rows


def read_records(path: Path) -> list[RequestRecord]:
    """Read ``records.jsonl``; raises ValueError naming the line of any malformed row."""
    return _read_jsonl(path, RequestRecord)


def read_series(path: Path) -> list[SeriesPoint]:
    """Read ``timeseries.jsonl``; raises ValueError naming the line of any malformed row."""
    return _read_jsonl(path, SeriesPoint)


# --- the run directory -------------------------------------------------------------------------------------

RECORDS = "records.jsonl"
SERIES = "timeseries.jsonl"
SUMMARY = "summary.json"


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


# --- math --------------------------------------------------------------------------------------------------


def tpot(ttft_s: float, e2e_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first; None when fewer than 2 tokens came."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def meets_slo(record: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """Whether a request counts toward goodput.

    Only completed requests can: refused and failed ones are misses, so shedding load cannot raise goodput.
    A ``None`` SLO is no constraint; a request with fewer than 2 tokens has no TPOT and passes that part.
    """
    if record.status != "ok" or record.ttft_s is None:
        return False
    if slo_ttft_s is not None and record.ttft_s > slo_ttft_s:
        return False
    return not (slo_tpot_s is not None and record.tpot_s is not None and record.tpot_s > slo_tpot_s)


def goodput(
    records: Sequence[RequestRecord], duration_s: float, slo_ttft_s: float | None, slo_tpot_s: float | None
) -> float:
    """Requests per second that completed within both SLOs; 0 for a non-positive duration."""
    if duration_s <= 0:
        return 0.0
    return sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records) / duration_s


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _latency_stats(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    ok = [r for r in records if r.status == "ok"]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "ttft_mean": _mean(ttft),
        "ttft_max": max(ttft, default=None),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p90": percentile(tpots, 90),
        "tpot_p99": percentile(tpots, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "itl_max": max(itl, default=None),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
    }


def _series_stats(series: Sequence[SeriesPoint]) -> dict[str, float | int | None]:
    kv = [p.kv_usage for p in series if p.kv_usage is not None]
    preempt = [p.preemptions for p in series if p.preemptions is not None]
    queue = [p.queue_depth for p in series if p.queue_depth is not None]
    rss = [p.rss_bytes for p in series if p.rss_bytes is not None]
    gpu = [p.gpu_mem_bytes for p in series if p.gpu_mem_bytes is not None]
    return {
        "kv_usage_mean": _mean(kv),
        "kv_usage_max": max(kv) if kv else None,
        "preemptions": max(preempt) if preempt else None,
        "queue_depth_max": max(queue) if queue else None,
        "rss_max_bytes": max(rss) if rss else None,
        "gpu_mem_max_bytes": max(gpu) if gpu else None,
    }


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_s: float | None,
    slo_tpot_s: float | None,
    series: Sequence[SeriesPoint] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fold a run into the ``summary.json`` dict.

    Throughput counts the output tokens of completed requests over the run's duration. KV usage and
    preemptions come from the time series (``None`` when the target does not report them). ``extra`` is merged
    in last (target name, workload description, memory figures...).
    """
    ok = [r for r in records if r.status == "ok"]
    counts = {s: sum(r.status == s for r in records) for s in STATUSES}
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
    summary: dict[str, Any] = {
        "requests": len(records),
        "ok": counts["ok"],
        "refused": counts["refused"],
        "failed": counts["failed"],
        "duration_s": duration_s,
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "request_rps": len(ok) / duration_s if duration_s > 0 else 0.0,
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        "slo_met": good,
        "slo_attainment": good / len(records) if records else None,
        "goodput_rps": goodput(records, duration_s, slo_ttft_s, slo_tpot_s),
        **_latency_stats(records),
        **_series_stats(series),
        "by_priority": _by_priority(records, duration_s, slo_ttft_s, slo_tpot_s),
    }
    if extra:
        summary.update(extra)
    return summary


def _by_priority(
    records: Sequence[RequestRecord], duration_s: float, slo_ttft_s: float | None, slo_tpot_s: float | None
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for prio in sorted({r.priority for r in records}):
        mine = [r for r in records if r.priority == prio]
        lat = _latency_stats(mine)
        out[str(prio)] = {
            "requests": len(mine),
            "refused": sum(r.status == "refused" for r in mine),
            "failed": sum(r.status == "failed" for r in mine),
            "goodput_rps": goodput(mine, duration_s, slo_ttft_s, slo_tpot_s),
            "ttft_p50": lat["ttft_p50"],
            "ttft_p99": lat["ttft_p99"],
            "tpot_p99": lat["tpot_p99"],
        }
    return out


def client_series(
    records: Sequence[RequestRecord], duration_s: float, period_s: float = 1.0
) -> list[SeriesPoint]:
    """Per-period client-side figures derived from the records: in-flight count, median TTFT, output rate.

    Point ``k`` covers ``((k-1)*period, k*period]`` and is stamped ``t_s = k*period``. Output tokens are
    spread evenly over each request's decode span (first token to end): what the stream delivered on average.
    """
    if period_s <= 0:
        raise ValueError(f"period_s={period_s}: must be > 0")
    n = max(1, math.ceil(duration_s / period_s))
    ttfts: list[list[float]] = [[] for _ in range(n)]
    tokens = [0.0] * n
    in_flight = [0] * n
    for r in records:
        end = r.arrival_s + (r.e2e_s or 0.0)
        # in flight at the stamps t_k = (k+1)*period with arrival <= t_k < end
        for k in range(max(0, math.ceil(r.arrival_s / period_s) - 1), min(n, math.ceil(end / period_s))):
            if r.arrival_s <= (k + 1) * period_s < end:
                in_flight[k] += 1
        if r.status != "ok" or r.ttft_s is None:
            continue
        first = r.arrival_s + r.ttft_s
        ttfts[min(n - 1, _period_of(first, period_s))].append(r.ttft_s)
        _spread(tokens, first, end, r.output_tokens, period_s)
    return [
        SeriesPoint(
            t_s=(k + 1) * period_s,
            in_flight=in_flight[k],
            ttft_p50_s=percentile(ttfts[k], 50),
            output_tok_s=tokens[k] / period_s,
        )
        for k in range(n)
    ]


def _period_of(t: float, period_s: float) -> int:
    return max(0, math.ceil(t / period_s) - 1)


def _spread(bins: list[float], start: float, end: float, amount: int, period_s: float) -> None:
    if amount <= 0:
        return
    if end <= start:
        bins[min(len(bins) - 1, _period_of(start, period_s))] += amount
        return
    rate = amount / (end - start)
    for k in range(_period_of(start, period_s), min(len(bins), _period_of(end, period_s) + 1)):
        lo, hi = max(start, k * period_s), min(end, (k + 1) * period_s)
        if hi > lo:
            bins[k] += rate * (hi - lo)


def merge_series(server: Sequence[SeriesPoint], client: Sequence[SeriesPoint]) -> list[SeriesPoint]:
    """Fill each server-scraped point's client fields from the client point of the same period.

    Server points keep their own stamps; each takes the client point whose period contains it.
    """
    if not client:
        return list(server)
    period = client[0].t_s
    merged: list[SeriesPoint] = []
    for p in server:
        c = client[min(len(client) - 1, _period_of(p.t_s, period))]
        merged.append(
            SeriesPoint(
                **{
                    **asdict(p),
                    "in_flight": c.in_flight,
                    "ttft_p50_s": c.ttft_p50_s,
                    "output_tok_s": c.output_tok_s,
                }
            )
        )
    return merged


__all__ = [
    "REFUSED_HTTP",
    "STATUSES",
    "RequestRecord",
    "SeriesPoint",
    "client_series",
    "goodput",
    "meets_slo",
    "merge_series",
    "percentile",
    "read_records",
    "read_series",
    "summarize",
    "tpot",
    "write_jsonl",
]
