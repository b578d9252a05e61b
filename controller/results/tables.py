"""The comparison table of run summaries, the order run directories are listed in, and a summary's
few lines for the terminal.

Shared by ``compare``, ``sweep``, ``report``, ``bench run`` and ``targets``, which all print or embed them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.results.records import SUMMARY, read_summary

VLLM_SERVE = "vllm-serve"

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("tok/s", "throughput_tok_s", ".1f"),
    ("goodput req/s", "goodput_rps", ".2f"),
    ("SLO met", "slo_attainment", ".0%"),
    ("TTFT p50 s", "ttft_p50", ".3f"),
    ("TTFT p99 s", "ttft_p99", ".3f"),
    ("TPOT p50 ms", "tpot_p50", "ms"),
    ("TPOT p99 ms", "tpot_p99", "ms"),
    ("ITL max ms", "itl_max", "ms"),
    ("preempt", "preemptions", "d"),
    ("KV mean", "kv_usage_mean", ".2f"),
    ("refused", "refused", "d"),
    ("failed", "failed", "d"),
    ("RSS max GiB", "rss_max_bytes", "gib"),
)
RATIOS: tuple[tuple[str, str], ...] = (
    ("tok/s x", "throughput_tok_s"),
    ("goodput x", "goodput_rps"),
    ("TTFT p99 x", "ttft_p99"),
)


def cell(value: Any, fmt: str = ".3f") -> str:
    """A figure for a table or the terminal: "-" when unknown; formats ``ms`` (seconds shown as ms),
    ``gib`` (bytes as GiB), ``d`` (an integer, from an int or float), else ``format(value, fmt)``."""
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{value * 1000:.1f}"
    if fmt == "gib":
        return f"{value / 2**30:.2f}"
    if fmt == "d":
        return str(int(value))
    return format(value, fmt)


def best_static(summaries: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    statics = [s for s in summaries if str(s["target"]).startswith(("static:", "best:"))]
    if not statics:
        return None
    return max(statics, key=lambda s: (s["goodput_rps"], s["throughput_tok_s"]))


def ratio(value: Any, base: Any) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return float(value) / float(base)


def table(
    summaries: Sequence[dict[str, Any]], ref: dict[str, Any] | None = None, note: str = "best static"
) -> str:
    """A markdown table: absolute figures, then ratios to ``ref`` (default: the best static server)."""
    ref = ref if ref is not None else best_static(summaries)
    head = ["server", *(c[0] for c in COLUMNS), *(r[0] for r in RATIOS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        cells = [str(s["target"]) + (f" ({note})" if s is ref else "")]
        cells += [cell(s.get(key), fmt) for _, key, fmt in COLUMNS]
        cells += [cell(ratio(s.get(key), ref.get(key) if ref else None), ".2f") for _, key in RATIOS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _rank(summary: dict[str, Any]) -> int:
    target = str(summary.get("target"))
    order = ((VLLM_SERVE, 0), ("static:", 1), ("best:", 2), ("policy:", 3))
    return next((rank for prefix, rank in order if target.startswith(prefix)), 4)


def run_dirs(out: Path) -> list[Path]:
    """Every run directory under ``out``: baseline, presets, best, policies, then anything else."""
    dirs = [p.parent for p in out.glob(f"*/{SUMMARY}")]
    return sorted(dirs, key=lambda d: (_rank(read_summary(d)), str(read_summary(d)["target"])))


def format_summary(s: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    return (
        f"{s['target']}: {s['requests']} requests "
        f"({s['ok']} ok, {s['refused']} refused, {s['failed']} failed) "
        f"in {s['duration_s']:.1f} s\n"
        f"  throughput {s['throughput_tok_s']:.1f} tok/s, goodput {s['goodput_rps']:.2f} req/s "
        f"(SLO TTFT {cell(s['slo_ttft_s'], 'g')} s, TPOT {cell(s['slo_tpot_s'], 'g')} s; "
        f"attainment {cell(s['slo_attainment'], '.1%')})\n"
        f"  TTFT p50/p99 {cell(s['ttft_p50'])}/{cell(s['ttft_p99'])} s, "
        f"TPOT p50/p99 {cell(s['tpot_p50'], '.4f')}/{cell(s['tpot_p99'], '.4f')} s, "
        f"KV mean/max {cell(s['kv_usage_mean'], '.2f')}/{cell(s['kv_usage_max'], '.2f')}, "
        f"preemptions {cell(s['preemptions'], 'd')}"
    )
