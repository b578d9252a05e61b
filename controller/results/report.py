"""``bench report``: matplotlib PNGs and a markdown report over one or more run directories.

Plots: throughput against latency (one point per run, joined in order for a sweep), goodput by run, the knobs
(admission limit, batch cap, running requests) against KV usage over time, and TTFT with queue depth over
time. Reads only the run directory files (``records``), so runs of ``bench run`` and of the simulator render
alike.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.results.records import SERIES, SUMMARY, SeriesPoint, read_series, read_summary
from controller.results.tables import cell, run_dirs
from controller.results.tables import table as make_table

REPORT = "report.md"
MAX_PANELS = 12


@dataclass(frozen=True)
class RunDir:
    dir: Path
    summary: dict[str, Any]
    series: list[SeriesPoint]

    @property
    def label(self) -> str:
        return str(self.summary.get("target") or self.dir.name)


def add_parser(cmds: Any) -> None:
    p = cmds.add_parser("report", help="plots and a markdown report over run directories")
    p.add_argument(
        "runs",
        nargs="+",
        type=Path,
        help="run directories, or directories holding them (compare or sweep outputs)",
    )
    p.add_argument("--out", type=Path, required=True, help="where report.md and the PNGs go")
    p.add_argument("--title", default="vllm-autopilot bench report")


def find_runs(paths: Sequence[Path]) -> list[Path]:
    """Run directories among ``paths``: each itself if it has a summary, else its subdirectories that do."""
    found: list[Path] = []
    for path in paths:
        if (path / SUMMARY).is_file():
            found.append(path)
            continue
        subs = run_dirs(path)  # baseline, presets, best swept, policies, then the rest by name
        if not subs:
            raise FileNotFoundError(f"{path}: no {SUMMARY} in it or in its subdirectories")
        found += subs
    return found


def load(dirs: Sequence[Path]) -> list[RunDir]:
    return [
        RunDir(d, read_summary(d), read_series(d / SERIES) if (d / SERIES).is_file() else []) for d in dirs
    ]


def main(args: argparse.Namespace) -> int:
    path = render(args.out, find_runs(args.runs), title=args.title)
    print(f"report: {path}")
    return 0


def render(out: Path, dirs: Sequence[Path], *, title: str, table: str | None = None) -> Path:
    """Write the PNGs and ``report.md`` into ``out``; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    runs = load(dirs)
    if not runs:
        raise FileNotFoundError("no run directories to report on")
    out.mkdir(parents=True, exist_ok=True)
    images = [
        ("Throughput against latency", plot_throughput_latency(runs, out / "throughput_latency.png")),
        ("Goodput by server", plot_goodput(runs, out / "goodput.png")),
        ("Knobs against KV usage over time", plot_knobs_kv(runs, out / "knobs_kv.png")),
        ("TTFT and queue depth over time", plot_ttft_queue(runs, out / "ttft_queue.png")),
    ]
    if table is None:
        table = make_table([r.summary for r in runs])
    lines = [f"# {title}", "", table.strip(), "", *_workload_lines(runs)]
    for heading, image in images:
        if image is not None:
            lines += [f"## {heading}", "", f"![{heading}]({image.relative_to(out).as_posix()})", ""]
    lines += ["## Runs", "", *(f"- `{r.label}`: {_run_line(r)}" for r in runs), ""]
    path = out / REPORT
    path.write_text("\n".join(lines))
    return path


def _workload_lines(runs: Sequence[RunDir]) -> list[str]:
    first = runs[0].summary
    work = first.get("workload") or {}
    if not work:
        return []
    return [
        f"Workload: {work.get('requests')} requests over {cell(work.get('span_s'), '.0f')} s "
        f"({cell(work.get('rate_rps'), '.2f')} req/s), "
        f"mean prompt {cell(work.get('prompt_tokens_mean'), '.0f')} "
        f"and output {cell(work.get('output_tokens_mean'), '.0f')} tokens; "
        f"SLO TTFT {first.get('slo_ttft_s')} s, "
        f"TPOT {first.get('slo_tpot_s')} s.",
        "",
    ]


def _run_line(run: RunDir) -> str:
    s = run.summary
    bits = [f"{s.get('requests')} requests in {cell(s.get('duration_s'), '.1f')} s"]
    if s.get("server"):
        bits.append(f"server {s['server']}")
    if s.get("control"):
        bits.append(f"control {s['control']}")
    if s.get("exit_code") not in (None, 0):
        bits.append(f"exit code {s['exit_code']}")
    return ", ".join(bits) + f" (`{run.dir.name}/`)"


# --- plots -----------------------------------------------------------------------------------------------


def plot_throughput_latency(runs: Sequence[RunDir], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, name in ((axes[0], "ttft_p99", "TTFT p99 (s)"), (axes[1], "tpot_p99", "TPOT p99 (s)")):
        points = [(r.summary["throughput_tok_s"], r.summary.get(key), r.label) for r in runs]
        points = [(x, y, label) for x, y, label in points if y is not None]
        if all("sweep" in r.summary for r in runs) and len(points) > 1:
            ax.plot([p[0] for p in points], [p[1] for p in points], "-", color="0.7", zorder=1)
        for x, y, label in points:
            ax.scatter([x], [y], zorder=2)
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        slo = runs[0].summary.get("slo_ttft_s" if key == "ttft_p99" else "slo_tpot_s")
        if slo is not None:
            ax.axhline(slo, color="red", linestyle="--", linewidth=0.8, label="SLO")
            ax.legend(fontsize=7)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    fig.suptitle("Throughput against tail latency (one point per run)")
    return _save(fig, path)


def plot_goodput(runs: Sequence[RunDir], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(runs) + 1.5))
    labels = [r.label for r in runs]
    values = [r.summary["goodput_rps"] for r in runs]
    bars = ax.barh(labels, values, color="tab:blue")
    for bar, r in zip(bars, runs, strict=True):
        met = r.summary.get("slo_attainment")
        text = f" {r.summary['goodput_rps']:.2f} req/s" + (f", {met:.0%} met SLO" if met is not None else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("goodput (requests/s within the TTFT and TPOT SLO; refused and failed count as misses)")
    ax.set_xlim(0, max([*values, 1e-9]) * 1.35)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, n)
    return math.ceil(n / cols), cols


def _series_axes(runs: Sequence[RunDir], title: str) -> tuple[Any, list[tuple[Any, RunDir]]]:
    import matplotlib.pyplot as plt

    shown = [r for r in runs if r.series][:MAX_PANELS]
    rows, cols = _grid(max(1, len(shown)))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(shown) :]:
        ax.axis("off")
    fig.suptitle(title)
    return fig, list(zip(flat, shown, strict=False))


def _xy(series: Sequence[SeriesPoint], field: str) -> tuple[list[float], list[float]]:
    pts = [(p.t_s, getattr(p, field)) for p in series if getattr(p, field) is not None]
    return [t for t, _ in pts], [float(v) for _, v in pts]


def plot_knobs_kv(runs: Sequence[RunDir], path: Path) -> Path | None:
    if not any(r.series for r in runs):
        return None
    fig, panels = _series_axes(runs, "Knobs (left) against KV cache usage (right, dashed)")
    for ax, run in panels:
        for field, style in (("admission_limit", "-"), ("batch_cap", "-"), ("running", ":")):
            ts, vs = _xy(run.series, field)
            if ts:
                ax.step(ts, vs, style, where="post", label=field, linewidth=1)
        ax.set_title(run.label, fontsize=9)
        ax.set_xlabel("s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6, loc="upper left")
        kv = ax.twinx()
        ts, vs = _xy(run.series, "kv_usage")
        kv.plot(ts, vs, "--", color="tab:red", linewidth=1)
        kv.set_ylim(0, 1.05)
        kv.set_ylabel("KV usage", color="tab:red", fontsize=8)
    return _save(fig, path)


def plot_ttft_queue(runs: Sequence[RunDir], path: Path) -> Path | None:
    if not any(r.series for r in runs):
        return None
    fig, panels = _series_axes(runs, "Median TTFT per second (left) and queue depth (right, dashed)")
    for ax, run in panels:
        ts, vs = _xy(run.series, "ttft_p50_s")
        ax.plot(ts, vs, color="tab:blue", linewidth=1)
        ax.set_ylabel("TTFT p50 (s)", color="tab:blue", fontsize=8)
        ax.set_title(run.label, fontsize=9)
        ax.set_xlabel("s")
        q = ax.twinx()
        for field, color in (("queue_depth", "tab:orange"), ("waiting", "tab:green")):
            ts, vs = _xy(run.series, field)
            if ts:
                q.step(ts, vs, "--", where="post", color=color, linewidth=1, label=field)
        q.set_ylim(bottom=0, top=max(1.0, q.get_ylim()[1]))
        ax.set_ylim(bottom=0)
        q.set_ylabel("requests", fontsize=8)
        q.legend(fontsize=6, loc="upper right")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
