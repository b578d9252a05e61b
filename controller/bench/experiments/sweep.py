"""``bench sweep``: the same workload on one server per value of one or two engine settings.

Each setting runs our daemon with the static policy holding it (or plain ``vllm serve`` with ``--server
vllm-serve``); memory is sampled over the run (process-tree RSS, NVML GPU memory when present). The
recommendation is the setting with the highest goodput for the given SLO, ties broken by less memory, then
by throughput; with no SLO, goodput is simply completed requests per second.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from typing import Any

from controller.bench.runner import add_slo_args
from controller.bench.servers import ServerSpec
from controller.bench.targets import (
    Bench,
    add_server_args,
    parse_value,
    prepare,
    run_dir,
    run_live,
    run_servers,
)
from controller.load.options import add_workload_args
from controller.results.report import render
from controller.results.tables import table

RESULT = "sweep.json"
TABLE = "sweep.md"
KNOWN = ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory_bytes")


def add_parser(cmds: Any) -> None:
    p = cmds.add_parser(
        "sweep", help="one server per value of one or two engine settings; recommend the best"
    )
    add_server_args(p)
    set_help = (
        f"an [engine] setting and its values (once or twice), e.g. max_num_seqs=8,16,32; usually one of "
        f"{', '.join(KNOWN)}; a TABLE.KEY sets the daemon's own, e.g. "
        "control.params.max_num_active_seqs=1,4,16 (one engine build: the compile cache serves the rest)"
    )
    p.add_argument(
        "--set", action="append", required=True, metavar="KEY=V1,V2,...", dest="sweep_set", help=set_help
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="every setting on one daemon, each in turn by reload (TABLE.KEY settings only)",
    )
    p.add_argument(
        "--server",
        choices=("daemon", "vllm-serve"),
        default="daemon",
        help="our daemon with the static policy (default) or plain vllm serve",
    )
    add_workload_args(p)
    add_slo_args(p)


def parse_sets(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["a=1,2", "b=x"]`` -> ``{"a": [1, 2], "b": ["x"]}``; one or two settings."""
    if not 1 <= len(items) <= 2:
        raise ValueError(f"--set given {len(items)} times: sweep one or two settings")
    out: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        vals = [parse_value(v) for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise ValueError(f"--set {item!r}: write KEY=V1,V2,..., e.g. --set max_num_seqs=8,16,32")
        if key in out:
            raise ValueError(f"--set {key} given twice")
        out[key.strip()] = vals
    return out


def settings(sets: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination, first setting varying slowest."""
    keys = list(sets)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(sets[k] for k in keys))]


def label(setting: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items())


def _daemon_tables(setting: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The dotted keys of ``setting`` (``control.params.max_num_active_seqs``, ``admission.limit``) as
    nested tables."""
    tables: dict[str, dict[str, Any]] = {}
    for key, value in setting.items():
        table, _, rest = key.partition(".")
        *parents, name = rest.split(".")
        node = tables.setdefault(table, {})
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return tables


def server_specs(bench: Bench, combos: Sequence[dict[str, Any]], kind: str) -> list[ServerSpec]:
    """One server per combination. A key with a dot is a daemon setting
    (``control.params.max_num_active_seqs``): the engine's arguments stay the same across such a
    sweep, so vLLM's compile cache serves every start."""
    admission = dict(bench.base.get("admission") or {})
    specs: list[ServerSpec] = []
    for setting in combos:
        daemon = {k: v for k, v in setting.items() if "." in k}
        engine = {**bench.engine, **{k: v for k, v in setting.items() if "." not in k}}
        if kind == "vllm-serve":
            if daemon:
                raise ValueError(
                    f"--set {next(iter(daemon))}: a daemon setting; sweep it with --server daemon"
                )
            specs.append(ServerSpec(label(setting), "vllm-serve", engine, tags={"sweep": setting}))
            continue
        tables = _daemon_tables(daemon)
        if not set(tables) <= {"control", "admission", "server"}:
            raise ValueError(f"--set {label(daemon)}: sweep keys of [control], [admission] or [server]")
        # The static policy holds max_num_seqs as the batch cap; the gate admits as many (no extra queueing).
        limit = {"limit": int(engine["max_num_seqs"])} if "max_num_seqs" in setting else {}
        control = tables.get("control", {})
        specs.append(
            ServerSpec(
                label(setting),
                "daemon",
                engine,
                {"policy": "static", **control, "params": control.get("params", {})},
                {**admission, **limit, **tables.get("admission", {})},
                tables.get("server", {}),
                tags={"sweep": setting},
            )
        )
    return specs


def _memory(s: dict[str, Any]) -> float:
    return float(s.get("gpu_mem_max_bytes") or s.get("rss_max_bytes") or 0)


def recommend(summaries: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The setting with the most goodput (ties: less memory, then more throughput); None if none has any."""
    good = [s for s in summaries if s["goodput_rps"] > 0 and s.get("failed", 0) < s["requests"]]
    if not good:
        return None
    best = max(good, key=lambda s: (round(s["goodput_rps"], 6), -_memory(s), s["throughput_tok_s"]))
    return {
        "setting": best["sweep"],
        "target": best["target"],
        "goodput_rps": best["goodput_rps"],
        "throughput_tok_s": best["throughput_tok_s"],
        "ttft_p99": best.get("ttft_p99"),
        "tpot_p99": best.get("tpot_p99"),
        "reason": "highest goodput within the SLO" + (", least memory among equals" if len(good) > 1 else ""),
    }


def main(args: argparse.Namespace) -> int:
    bench = prepare(args)
    combos = settings(parse_sets(args.sweep_set))
    specs = server_specs(bench, combos, args.server)
    if args.live and any("." not in key for combo in combos for key in combo):
        raise ValueError(
            "--live sweeps daemon settings (TABLE.KEY) only: an [engine] setting needs a new engine"
        )
    summaries = run_live(bench, specs, args.out) if args.live else run_servers(bench, specs, args.out)
    rec = recommend(summaries)
    ref = next((s for s in summaries if rec and s["target"] == rec["target"]), None)
    if rec:
        advice = (
            f"Recommended for SLO TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s: {label(rec['setting'])} "
            f"({rec['goodput_rps']:.2f} req/s goodput, {rec['throughput_tok_s']:.0f} tok/s)."
        )
    else:
        advice = "No setting completed any request within the SLO: loosen it or lower the load."
    text = table(summaries, ref, note="recommended") + "\n\n" + advice
    (args.out / TABLE).write_text(text + "\n")
    (args.out / RESULT).write_text(
        json.dumps({"server": args.server, "recommendation": rec, "runs": list(summaries)}, indent=2) + "\n"
    )
    report = render(args.out, [run_dir(args.out, s.name) for s in specs], title="bench sweep", table=text)
    print("\n" + text + f"\nreport: {report}")
    return 0 if rec else 1
