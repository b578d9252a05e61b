"""``vllm-autopilot simulate --grid``: one policy against vLLM's defaults and a grid of static settings
(admission limit x token budget x queue deadline), on the same requests and SLO, ratios printed from
the one run.

A grid point is the static policy at ``admission_limit = L`` and ``max_num_scheduled_tokens = B``
(the token budget; the batch cap at the engine's ``max_num_seqs``, as vLLM has it) with every class's
queue deadline at ``D``; "defaults" is the static policy with ``[admission]`` and the engine as given
(vLLM's own settings and no gate limit below them). Writes ``grid.json`` (every summary row, the best
point and the ratios) and ``grid.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from controller.config.load import AdmissionConfig, ControlConfig
from controller.load.workload import RequestSpec
from controller.profiles.load import Profile
from controller.results.tables import SIM_COLUMNS, render_table
from controller.sim.compare import KEYS
from controller.sim.twin import build_simulation, write_result
from policies.slo_targets import SloTargets

AXES = {"limit": int, "budget": int, "deadline": float}
"""The grid's axes (``--grid limit=24,48 budget=1024,8192 deadline=0.8,5``) and their types."""


@dataclasses.dataclass(frozen=True)
class GridRun:
    """One configuration of the grid run: its name, the ``[control]`` and ``[admission]`` it runs."""

    name: str
    control: ControlConfig
    admission: AdmissionConfig


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``KEY=V1,V2,...`` for each axis of ``AXES``; every axis must be given."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in AXES:
            raise ValueError(f"--grid {item!r}: write KEY=V1,V2 with KEY one of {', '.join(AXES)}")
        try:
            grid[key] = [AXES[key](v) for v in raw.split(",") if v.strip()]
        except ValueError as exc:
            raise ValueError(f"--grid {item!r}: {exc}") from None
    missing = [k for k in AXES if not grid.get(k)]
    if missing:
        raise ValueError(f"--grid: give every axis ({', '.join(missing)} missing), e.g. limit=48,96")
    return grid


def runs(grid: dict[str, list[Any]], control: ControlConfig, admission: AdmissionConfig) -> list[GridRun]:
    """The policy of ``control`` as given, vLLM's defaults, then every grid point."""
    static = dataclasses.replace(control, policy="static", params={})
    out = [GridRun(control.policy, control, admission), GridRun("defaults", static, admission)]
    for limit, budget, deadline in itertools.product(grid["limit"], grid["budget"], grid["deadline"]):
        classes = tuple(dataclasses.replace(c, queue_deadline_s=deadline) for c in admission.classes)
        params = {"admission_limit": limit, "max_num_scheduled_tokens": budget}
        point = dataclasses.replace(control, policy="static", params=params)
        name = f"static L{limit} B{budget} D{deadline:g}"
        out.append(GridRun(name, point, dataclasses.replace(admission, classes=classes)))
    return out


Job = tuple[GridRun, Profile, SloTargets | None, Sequence[RequestSpec], dict[str, Any]]


def _one(job: Job) -> dict[str, Any]:
    """One configuration through the twin (a process pool's task): its summary row."""
    run, profile, slo, specs, opts = job
    sim = build_simulation(
        profile, run.control, run.admission, seed=opts["seed"], slo=slo, use_variance=opts["use_variance"]
    )
    result = asyncio.run(sim.run(specs))
    result.extra.update(kind="sim", policy=run.control.policy, policy_params=dict(run.control.params))
    summary = result.summary(opts["slo_ttft"], opts["slo_tpot"])
    if opts["out"] is not None:
        write_result(opts["out"] / run.name.replace(" ", "_"), result, summary)
    return {"config": run.name, **{k: summary[k] for k in KEYS}}


def run_grid(
    args: argparse.Namespace,
    profile: Profile,
    control: ControlConfig,
    admission: AdmissionConfig,
    specs: Sequence[RequestSpec],
    slo: SloTargets | None,
) -> int:
    """Every configuration of ``runs``; the table, the best grid point and the ratios."""
    todo = runs(parse_grid(args.grid), control, admission)
    opts = {
        "seed": args.seed,
        "use_variance": not args.no_variance,
        "slo_ttft": args.slo_ttft,
        "slo_tpot": args.slo_tpot,
        "out": args.out if args.grid_runs else None,
    }
    jobs = [(r, profile, slo, specs, opts) for r in todo]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = []
        for row in pool.map(_one, jobs):
            rows.append(row)
            print(json.dumps(row), flush=True)
    policy, defaults, *points = rows
    best = max(points, key=lambda r: r["goodput_rps"])
    ratios = {
        f"{policy['config']} / defaults": _ratio(policy, defaults),
        f"{policy['config']} / best grid point ({best['config']})": _ratio(policy, best),
        "best grid point / defaults": _ratio(best, defaults),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "profile": profile.name,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "grid": args.grid,
        "workload": args.workload_desc,
    }
    body = {"meta": meta, "runs": rows, "best": best["config"], "ratios": ratios}
    (args.out / "grid.json").write_text(json.dumps(body, indent=2) + "\n")
    lines = [render_table(SIM_COLUMNS, rows), "", *(f"- {k}: {v:.3f}" for k, v in ratios.items())]
    (args.out / "grid.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return 0


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    return float(a["goodput_rps"]) / float(b["goodput_rps"]) if b["goodput_rps"] else float("inf")
