"""The tables of run summaries (the servers' comparison, the twin's configurations), the order run
directories are listed in, and a summary's line or few lines for the terminal.

Shared by ``compare``, ``sweep``, ``report``, ``bench run``, ``targets`` and ``simulate`` (its run, ``--grid``
and ``--compare``), which all print or embed them. A table is a tuple of :class:`Column` rendered by
:func:`render_table`; every figure goes through :func:`cell`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.results.records import SUMMARY, read_summary

VLLM_SERVE = "vllm-serve"


@dataclass(frozen=True)
class Column:
    """One column of a summary table: its header and the figure it shows, a key of the row and its
    :func:`cell` format; ``more`` figures share the cell after " / " (a p50 and its p99)."""

    header: str
    key: str
    fmt: str = ""
    more: tuple[tuple[str, str], ...] = ()

    def text(self, row: Mapping[str, Any]) -> str:
        return " / ".join(cell(row.get(key), fmt) for key, fmt in ((self.key, self.fmt), *self.more))


COLUMNS: tuple[Column, ...] = (
    Column("tok/s", "throughput_tok_s", ".1f"),
    Column("goodput req/s", "goodput_rps", ".2f"),
    Column("SLO met", "slo_attainment", ".0%"),
    Column("TTFT p50 s", "ttft_p50", ".3f"),
    Column("TTFT p99 s", "ttft_p99", ".3f"),
    Column("TPOT p50 ms", "tpot_p50", "ms"),
    Column("TPOT p99 ms", "tpot_p99", "ms"),
    Column("ITL max ms", "itl_max", "ms"),
    Column("preempt", "preemptions", "d"),
    Column("KV mean", "kv_usage_mean", ".2f"),
    Column("refused", "refused", "d"),
    Column("failed", "failed", "d"),
    Column("RSS max GiB", "rss_max_bytes", "gib"),
)
"""The servers' table (:func:`table`): absolute figures, before the ratios."""
RATIOS: tuple[tuple[str, str], ...] = (
    ("tok/s x", "throughput_tok_s"),
    ("goodput x", "goodput_rps"),
    ("TTFT p99 x", "ttft_p99"),
)

SIM_COLUMNS: tuple[Column, ...] = (
    Column("config", "config"),
    Column("goodput req/s", "goodput_rps", ".2f"),
    Column("SLO met", "slo_attainment", ".1%"),
    Column("tok/s", "throughput_tok_s", ".0f"),
    Column("TTFT p50 / p99 s", "ttft_p50", ".3f", more=(("ttft_p99", ".2f"),)),
    Column("TPOT p99 ms", "tpot_p99", "ms.0f"),
    Column("preemptions", "engine_preemptions", "d"),
    Column("limit changes", "limit_changes", "d"),
    Column("max gate queue", "queue_depth_max", "d"),
)
"""The twin's table (``simulate --compare`` and ``--grid``): one row per configuration, its name in
``config``."""


def cell(value: Any, fmt: str = ".3f", unit: str = "") -> str:
    """A figure for a table or the terminal, ``unit`` after it: "-" when unknown; formats ``ms``
    (seconds shown as ms, ``.1f`` unless a spec follows: ``ms.0f``), ``gib`` (bytes as GiB, ``.2f``),
    ``d`` (an integer, from an int or float), else ``format(value, fmt)`` (``""``: as ``str``)."""
    if value is None:
        return "-"
    if fmt.startswith("ms"):
        return format(value * 1000, fmt[2:] or ".1f") + unit
    if fmt == "gib":
        return f"{value / 2**30:.2f}{unit}"
    if fmt == "d":
        return f"{int(value)}{unit}"
    return format(value, fmt) + unit


def markdown(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table of cells already written out."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def render_table(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]]) -> str:
    """A markdown table of ``rows`` (summaries, or rows cut from them), one line each."""
    return markdown([c.header for c in columns], ([c.text(row) for c in columns] for row in rows))


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
    head = ["server", *(c.header for c in COLUMNS), *(r[0] for r in RATIOS)]
    rows = []
    for s in summaries:
        cells = [str(s["target"]) + (f" ({note})" if s is ref else "")]
        cells += [c.text(s) for c in COLUMNS]
        cells += [cell(ratio(s.get(key), ref.get(key) if ref else None), ".2f") for _, key in RATIOS]
        rows.append(cells)
    return markdown(head, rows)


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


def format_sim_summary(s: dict[str, Any]) -> str:
    """A twin run's line for the terminal (``simulate``): its summary as ``SimResult.summary`` writes it."""
    ms = [cell(s[key], "ms.0f", " ms") for key in ("ttft_p50", "ttft_p99", "tpot_p99")]
    return (
        f"{s.get('policy', '?')}: {s['requests']} requests ({s['refused']} refused, {s['failed']} failed), "
        f"goodput {s['goodput_rps']:.2f} req/s, throughput {s['throughput_tok_s']:.0f} tok/s, "
        f"TTFT p50/p99 {ms[0]}/{ms[1]}, TPOT p99 {ms[2]}, "
        f"preemptions {s['engine_preemptions']}, limit changes {s['limit_changes']}, "
        f"{s['duration_s']:.0f} s simulated in {s['sim_wall_s']:.1f} s"
    )
