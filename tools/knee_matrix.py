"""The twin's matrix of loads past the knee (docs/results/knee.md): for each load, ``vllm-autopilot
simulate --grid`` runs the ``slo`` policy, vLLM's defaults and a 27-point static grid (admission
limit x token budget x queue deadline) on the same requests and SLO; this prints one table of the
``slo`` policy against the best grid point of each load, and writes it as ``OUT/matrix.md``.

Usage: ``python tools/knee_matrix.py OUT [--only NAME ...] [--jobs N] [--seeds 0 1 2]``; the daemon's
own ``vllm-autopilot`` on PATH runs each load (``--cli`` names another, e.g. an older checkout's).

With more than one seed (the twin's front-end and step-time draws), each seed's grid goes to
``OUT/seedN/`` and a second table, ``OUT/seeds.md``, sets ``slo`` against two baselines on every seed:
the best point of that seed's grid (chosen after the fact, per load and per seed: an oracle no fixed
setting is), and the one point of the grid an operator would hand-set for the hardware, the point
whose worst ratio to the best over that profile's loads at the first seed is highest, kept for every
load and seed (``fixed_point``)."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

T = "traces/azure_llm_2023"
CPU = "--profile cpu-smollm2-avx512 --slo-ttft 2 --slo-tpot 0.08"
CPU_GRID = "--grid limit=4,6,12 budget=128,256,2048 deadline=1,1.5,2"
SP = "--workload shared-prefix --turns 1"
CPU_SP = f"{SP} --output-tokens 48 --system-prompts 4 --system-tokens 480 --user-tokens 48"
H200 = "--profile h200-8b --slo-ttft 1 --slo-tpot 0.04"
H200_GRID = "--grid limit=32,64,128 budget=512,2048,8192 deadline=0.5,0.8,1"
H200_SP = f"{SP} --output-tokens 256 --system-prompts 8 --system-tokens 2000 --user-tokens 200"

LOADS: dict[str, str] = {
    # SmolLM2 on a CPU with AVX-512 BF16: the best static point serves about 1.7 good req/s here, so
    # 1.5 req/s is below the knee, 2.5 at it, 4 and 6 past it (TPOT bound 80 ms: 3.5x the step's 23 ms)
    "cpu-sp-1.5": f"{CPU} {CPU_SP} --rate 1.5 --duration 120 {CPU_GRID}",
    "cpu-sp-2.5": f"{CPU} {CPU_SP} --rate 2.5 --duration 120 {CPU_GRID}",
    "cpu-sp-4": f"{CPU} {CPU_SP} --rate 4 --duration 120 {CPU_GRID}",
    "cpu-sp-6": f"{CPU} {CPU_SP} --rate 6 --duration 60 {CPU_GRID}",
    "cpu-conv": f"{CPU} --trace {T}_conv.csv --token-scale 0.2 --time-scale 0.5 --duration 120 {CPU_GRID}",
    "cpu-code": f"{CPU} --trace {T}_code.csv --token-scale 0.1 --time-scale 0.5 --duration 120 {CPU_GRID}",
    # an 8B model on an H200 (TPOT bound 40 ms: several times the step's fixed cost)
    "h200-sp-15": f"{H200} {H200_SP} --rate 15 --duration 60 {H200_GRID}",
    "h200-sp-25": f"{H200} {H200_SP} --rate 25 --duration 60 {H200_GRID}",
    "h200-sp-40": f"{H200} {H200_SP} --rate 40 --duration 60 {H200_GRID}",
    "h200-sp-60": f"{H200} {H200_SP} --rate 60 --duration 60 {H200_GRID}",
    "h200-conv-4x": f"{H200} --trace {T}_conv.csv --time-scale 4 --duration 600 {H200_GRID}",
    "h200-code-2x": f"{H200} --trace {T}_code.csv --time-scale 2 --duration 600 {H200_GRID}",
    "h200-alt": f"{H200} --trace {T}_conv.csv --time-scale 4 --alternate {T}_code.csv:2 "
    f"--phase-s 120 --total-s 480 {H200_GRID}",
}
PHASE_CHANGING = frozenset({"h200-alt"})
"""Loads whose phases want different static points: there ``slo`` must beat the best one by 10 %."""


def run(name: str, out: Path, cli: str, jobs: int, extra: str = "") -> dict[str, object]:
    """One load's grid (skipped where ``out/name/grid.json`` exists), as written by ``simulate``."""
    grid = out / name / "grid.json"
    if not grid.exists():
        args = [*shlex.split(LOADS[name]), *shlex.split(extra), "--jobs", str(jobs), "--out", str(out / name)]
        cmd = [*shlex.split(cli), "simulate", *args]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data: dict[str, object] = json.loads(grid.read_text())
    return data


def row(name: str, grid: dict[str, object]) -> str:
    runs = {r["config"]: r for r in grid["runs"]}  # type: ignore[attr-defined]
    best = str(grid["best"])
    slo, top, defaults = (runs[k]["goodput_rps"] for k in ("slo", best, "defaults"))
    admitted = runs["slo"]["requests"] - runs["slo"]["refused"]
    good = runs["slo"]["slo_attainment"] * runs["slo"]["requests"]
    share = good / admitted if admitted else float("nan")
    target = 1.1 if name in PHASE_CHANGING else 0.97
    ratio = slo / top if top else float("inf")
    met = "met" if ratio >= target else "NOT met"
    return (
        f"| {name} | {defaults:.2f} | {best.removeprefix('static ')}: {top:.2f} | {slo:.2f} | "
        f"{ratio:.3f}x | {share:.0%} | >= {target:g}x: {met} |"
    )


def goodputs(grid: dict[str, Any]) -> dict[str, float]:
    """Good requests a second of each configuration of one grid, by its name."""
    return {str(r["config"]): float(r["goodput_rps"]) for r in grid["runs"]}


def ratio_to_best(grid: dict[str, Any], config: str) -> float:
    """``config``'s good requests a second over the best static point's of one grid."""
    runs = goodputs(grid)
    top = runs[str(grid["best"])]
    return runs[config] / top if top else 1.0


def fixed_point(grids: dict[str, dict[str, Any]]) -> str:
    """Of the static points every grid shares, the one whose worst ratio to each grid's best is the
    highest: the single setting an operator who knew every load would pick (ties: the first)."""
    points = [p for p in goodputs(next(iter(grids.values()))) if p.startswith("static ")]
    shared = [p for p in points if all(p in goodputs(g) for g in grids.values())]
    if not shared:
        raise ValueError("the grids share no static point: run them with the same --grid")
    return max(shared, key=lambda p: min(ratio_to_best(g, p) for g in grids.values()))


def seeds_table(grids: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    """Per load and seed: ``slo``, the seed's best point and the profile's fixed point
    (``fixed_point`` over the first seed's grids of the loads of that profile), with the ratios."""
    seeds = sorted({s for _, s in grids})
    names = list(dict.fromkeys(n for n, _ in grids))
    family = {n: n.split("-")[0] for n in names}  # cpu-..., h200-...: one hand-set point per profile
    fixed = {
        f: fixed_point({n: grids[(n, seeds[0])] for n in names if family[n] == f})
        for f in dict.fromkeys(family.values())
    }
    lines = [
        "| load | seed | `slo` | best point of the seed | `slo` / best | fixed point | `slo` / fixed |",
        "| --- | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    for n in names:
        point = fixed[family[n]]
        for s in seeds:
            g = grids[(n, s)]
            runs = goodputs(g)
            best, slo = str(g["best"]), runs["slo"]
            lines.append(
                f"| {n} | {s} | {slo:.2f} | {best.removeprefix('static ')}: {runs[best]:.2f} | "
                f"{slo / runs[best]:.3f}x | {point.removeprefix('static ')}: {runs[point]:.2f} | "
                f"{slo / runs[point]:.3f}x |"
            )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", nargs="*", default=None, help="load names (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    here = Path(sys.executable).parent / "vllm-autopilot"  # the venv this runs in
    ap.add_argument("--cli", default=str(here), help="the command that runs simulate")
    ap.add_argument("--extra", default="", help="more simulate options for every load, e.g. --param K=V")
    ap.add_argument("--seeds", type=int, nargs="*", default=None, help="twin seeds (several: OUT/seedN)")
    args = ap.parse_args()
    names = args.only or list(LOADS)
    if args.seeds and len(args.seeds) > 1:
        grids = {
            (n, s): run(n, args.out / f"seed{s}", args.cli, args.jobs, f"{args.extra} --seed {s}")
            for n in names
            for s in args.seeds
        }
        table = seeds_table(grids)
        (args.out / "seeds.md").write_text("\n".join(table) + "\n")
        print("\n".join(table))
        return 0
    if args.seeds:
        args.extra = f"{args.extra} --seed {args.seeds[0]}"
    lines = [
        "| load | vLLM defaults | best static point | `slo` | `slo` / best | admitted good | must show |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for name in names:
        lines.append(row(name, run(name, args.out, args.cli, args.jobs, args.extra)))
        print(lines[-1], flush=True)
    (args.out / "matrix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
