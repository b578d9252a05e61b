"""``bench compare``: one workload against plain ``vllm serve`` defaults, each static preset, the best swept
setting and each policy, one server at a time; a table of absolute figures and ratios to the best static.

"Best static" is the static server (a preset or the swept setting) with the highest goodput, ties broken by
throughput. Ratios are computed from runs of the same invocation (or of ``--resume``d ones on the same
workload), never against figures measured elsewhere.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.bench.runner import add_slo_args
from controller.bench.servers import ServerSpec
from controller.bench.targets import (
    TUNED_KEYS,
    Bench,
    add_server_args,
    parse_assignments,
    prepare,
    run_servers,
)
from controller.load import phases
from controller.load.options import add_workload_args
from controller.results.records import RECORDS, SERIES, read_records, read_series, read_summary
from controller.results.report import render
from controller.results.tables import VLLM_SERVE, best_static, run_dirs, table

TABLE = "compare.md"
PHASES_TABLE = "phases.md"
DAEMON = "daemon"
SAME_ENGINE = "vllm-serve:engine"
RESULT = "compare.json"


def add_parser(cmds: Any) -> None:
    p = cmds.add_parser(
        "compare", help="vllm serve defaults vs static presets vs the best swept setting vs policies"
    )
    add_server_args(p)
    p.add_argument(
        "--targets",
        default="all",
        help="comma list of: vllm-serve, static:PRESET, static:all, best, policy:NAME, policy:all "
        "(default all: every one of them); also daemon (the config as it is, admission limit = "
        "max_num_seqs, so nothing queues in the gate) and vllm-serve:engine (vllm serve with the same "
        "[engine], tuned settings included)",
    )
    p.add_argument(
        "--best",
        action="append",
        metavar="KEY=VALUE",
        help="[engine] setting of the best swept setting (repeatable), e.g. max_num_seqs=32; run on our "
        "daemon with the static policy (labelled best:static:...; --best-from runs a sweep's own server)",
    )
    p.add_argument("--best-from", type=Path, help="take --best from a sweep's sweep.json recommendation")
    p.add_argument(
        "--policy-param",
        action="append",
        metavar="POLICY.KEY=VALUE",
        help="a parameter for one policy (repeatable), e.g. pid.setpoint=0.9",
    )
    add_workload_args(p)
    add_slo_args(p)


def presets() -> list[str]:
    from policies.static import PRESETS

    return list(PRESETS)


def policies() -> list[str]:
    from policies.base import BUILT_INS

    return sorted(n for n in BUILT_INS if n != "static")


def best_setting(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The best swept [engine] setting and the server it was found for: ``--best-from`` a sweep's
    result (its ``--server``, our daemon unless it swept plain vllm serve), else ``--best`` on our
    daemon."""
    if args.best_from is not None:
        path = args.best_from / "sweep.json" if args.best_from.is_dir() else args.best_from
        result = json.loads(path.read_text())
        rec = result.get("recommendation")
        if not rec:
            raise ValueError(f"--best-from {path}: no recommendation (no setting met the SLO?)")
        return dict(rec["setting"]), str(result.get("server", "daemon"))
    return parse_assignments(args.best or [], "--best"), "daemon"


def policy_params(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in parse_assignments(items, "--policy-param").items():
        policy, dot, param = key.partition(".")
        if not dot:
            raise ValueError(f"--policy-param {key}: write POLICY.KEY=VALUE, e.g. pid.setpoint=0.9")
        out.setdefault(policy, {})[param] = value
    return out


def servers(bench: Bench, args: argparse.Namespace) -> list[ServerSpec]:
    """The servers ``--targets`` names, in a fixed order: baseline, presets, best, policies."""
    engine = bench.engine
    admission = dict(bench.base.get("admission") or {})
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    if "all" in wanted:
        wanted = [VLLM_SERVE, "static:all", "best", "policy:all"]
    out: list[ServerSpec] = []
    for item in wanted:
        out += _expand(item, engine, admission, args)
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--targets {args.targets}: names a server twice ({names})")
    return out


def _expand(
    item: str, engine: dict[str, Any], admission: dict[str, Any], args: argparse.Namespace
) -> list[ServerSpec]:
    if item == VLLM_SERVE:
        defaults = {k: v for k, v in engine.items() if k not in TUNED_KEYS}
        return [ServerSpec(VLLM_SERVE, "vllm-serve", defaults)]
    if item == SAME_ENGINE:
        return [ServerSpec(SAME_ENGINE, "vllm-serve", engine)]
    if item == DAEMON:
        control = {"policy": "static", "params": {}}
        return [ServerSpec(DAEMON, "daemon", engine, control, {**admission, "limit": engine["max_num_seqs"]})]
    kind, _, name = item.partition(":")
    if kind == "static" and name:
        names = presets() if name == "all" else [name]
        bad = [n for n in names if n not in presets()]
        if bad:
            raise ValueError(f"--targets static:{bad[0]}: no such preset; use one of {', '.join(presets())}")
        return [
            ServerSpec(
                f"static:{n}", "daemon", engine, {"policy": "static", "params": {"preset": n}}, admission
            )
            for n in names
        ]
    if item == "best":
        setting, server = best_setting(args)
        if not setting:
            return []  # nothing swept: the comparison goes on without it
        named = ",".join(f"{k}={v}" for k, v in setting.items())
        if server == "vllm-serve":
            return [ServerSpec(f"best:{VLLM_SERVE}:{named}", "vllm-serve", {**engine, **setting})]
        label = f"best:static:{named}"  # our daemon, its static gate at max_num_seqs: not vllm serve
        limit = {"limit": setting["max_num_seqs"]} if "max_num_seqs" in setting else {}
        return [
            ServerSpec(
                label,
                "daemon",
                {**engine, **setting},
                {"policy": "static", "params": {}},
                {**admission, **limit},
            )
        ]
    if kind == "policy" and name:
        names = policies() if name == "all" else [name]
        params = policy_params(args.policy_param or [])
        return [
            ServerSpec(f"policy:{n}", "daemon", engine, {"policy": n, "params": params.get(n, {})}, admission)
            for n in names
        ]
    raise ValueError(
        f"--targets {item!r}: use vllm-serve, vllm-serve:engine, daemon, static:PRESET, static:all, best, "
        "policy:NAME or policy:all"
    )


def main(args: argparse.Namespace) -> int:
    bench = prepare(args)
    specs = servers(bench, args)
    if not specs:
        raise ValueError(f"--targets {args.targets}: names no server")
    run_servers(bench, specs, args.out)
    dirs = run_dirs(args.out)  # this invocation's runs and any kept from earlier ones (--resume)
    summaries = [read_summary(d) for d in dirs]
    same_workload(summaries)
    write_table(args.out, summaries, bench)
    if args.workload == "phases":
        write_phases(args.out, dirs, args)
    report = render(args.out, dirs, title="bench compare", table=(args.out / TABLE).read_text())
    print(f"table: {args.out / TABLE}; report: {report}")
    return 0


def same_workload(summaries: Sequence[dict[str, Any]]) -> None:
    """Refuse to compare runs of other workloads or SLOs (--resume into another comparison's --out)."""
    keys = ("workload", "slo_ttft_s", "slo_tpot_s")
    for s in summaries[1:]:
        if any(s.get(k) != summaries[0].get(k) for k in keys):
            raise ValueError(
                f"{s['target']} was measured on another workload or SLO than {summaries[0]['target']}: "
                "use another --out"
            )


def write_phases(out: Path, dirs: Sequence[Path], args: argparse.Namespace) -> None:
    """``phases.md``: per-phase goodput, p99 TTFT and preemptions of every run, ratios to the best static."""
    results = {
        str(read_summary(d)["target"]): phases.summarize(
            read_records(d / RECORDS), read_series(d / SERIES), args.slo_ttft, args.slo_tpot
        )
        for d in dirs
    }
    text = phases.markdown(results)
    (out / PHASES_TABLE).write_text(text + "\n")
    print("\n" + text)


def write_table(out: Path, summaries: Sequence[dict[str, Any]], bench: Bench) -> None:
    ref = best_static(summaries)
    workload = summaries[0].get("workload") if summaries else None
    text = "\n".join(
        [
            table(summaries),
            "",
            f"Ratios are to the best static server ({ref['target'] if ref else 'none run'}): "
            "the static preset or swept setting with the highest goodput. TTFT p99 x below 1 is better.",
            f"Workload: {json.dumps(workload)}; "
            f"SLO TTFT {bench.args.slo_ttft} s, TPOT {bench.args.slo_tpot} s.",
        ]
    )
    (out / TABLE).write_text(text + "\n")
    (out / RESULT).write_text(
        json.dumps({"best_static": ref and ref["target"], "runs": list(summaries)}, indent=2) + "\n"
    )
    print("\n" + text)
