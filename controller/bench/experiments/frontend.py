"""``bench frontend``: the daemon's request path against plain ``vllm serve`` with the same engine.

Both servers get the same ``vllm serve`` engine flags (model, dtype, max_num_seqs, max_model_len, KV bytes,
and eager mode left at vLLM's default for both): plain ``vllm serve MODEL FLAGS`` and the drop-in
``vllm-autopilot serve MODEL FLAGS`` (no file of ours, so its defaults). They run in interleaved pairs, one
server at a time, the order alternating from pair to pair: on a box whose load drifts (other jobs, thermal
state), two runs minutes apart differ more than the two servers do, and only a pair measured back to back
is comparable. Each server gets a warm-up burst (unrecorded), then ``--bursts`` recorded bursts of
``--streams`` concurrent streams, all sent at once, with fixed prompts and a forced output length; its run's
figures are the medians over its bursts. The verdict is the median over pairs of daemon / vllm serve.

``--layers`` measures instead, in this process, the CPU each layer of the daemon's request path adds per
request, over a fake engine (``frontend_layers.py``): the front end's own cost, free of the box's noise.

``--lock FILE`` holds an flock on FILE for each pair (its two starts, bursts and stops), never between
pairs, so that other users of a shared box can take turns. ``--profile-bursts N`` runs N more bursts
after the recorded ones with py-spy sampling the server's processes (its API server, EngineCore and
worker) and writes the collapsed stacks to ``OUT/profile/``; those bursts' figures, slowed by the
sampling, are kept apart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from controller.bench import pyspy
from controller.bench.servers import HOST, engine_flags, free_port, log_tail, stop, wait_healthy
from controller.bench.targets import parse_assignments
from controller.load.client import Target, run_open_loop
from controller.load.prompts import PromptBuilder, load_tokenizer
from controller.load.workload import RequestSpec
from controller.percentile import percentile
from controller.results.records import RequestRecord

RESULT = "frontend.json"
VLLM_SERVE = "vllm-serve"
DAEMON = "daemon"
KINDS = (VLLM_SERVE, DAEMON)
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16",  # explicit: the daemon resolves "auto" per CPU (dtype.py), vllm serve does not
    "max_num_seqs": 64,
    "max_model_len": 2048,
    "kv_cache_memory_bytes": 268435456,  # on a CPU vLLM's default sizing fails; the same bytes for both
}
FIGURES = ("wall_s", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s")
HIGHER_IS_BETTER = ("output_tok_s",)


def add_parser(cmds: Any) -> None:
    p = cmds.add_parser(
        "frontend", help="the drop-in daemon against vllm serve, same engine, interleaved pairs"
    )
    p.add_argument("--model", type=Path, default=Path("models/tiny"), help="local model dir (default tiny)")
    p.add_argument("--out", type=Path, required=True, help=f"directory for {RESULT}, the logs and profiles")
    p.add_argument(
        "--engine",
        action="append",
        metavar="KEY=VALUE",
        help="an engine setting for both servers (repeatable); defaults: "
        + ", ".join(f"{k}={v}" for k, v in ENGINE_DEFAULTS.items()),
    )
    p.add_argument(
        "--daemon-arg",
        action="append",
        metavar="ARG",
        help="a daemon argument (repeatable), e.g. --daemon-arg=--config=x.toml",
    )
    p.add_argument("--pairs", type=int, default=5, help="interleaved pairs (default 5)")
    p.add_argument("--bursts", type=int, default=5, help="recorded bursts per server start (default 5)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams in a burst (default 64)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    p.add_argument("--output-tokens", type=int, default=64, help="forced output length (default 64)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a stream may take")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for health")
    p.add_argument("--lock", type=Path, help="flock this file for each pair (a box shared with other runs)")
    p.add_argument(
        "--profile-bursts",
        type=int,
        default=0,
        help="after the recorded bursts, this many under py-spy (default 0: none)",
    )
    p.add_argument(
        "--layers",
        action="store_true",
        help="no servers: each layer's CPU a request, fake engine, --pairs rounds",
    )


@dataclass(frozen=True)
class Burst:
    """One burst's figures (seconds, tokens per second)."""

    wall_s: float
    output_tok_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    ok: int
    failed: int


def burst_figures(records: Sequence[RequestRecord], wall_s: float) -> Burst:
    """A burst's figures from its records; ``wall_s`` runs from the send of the first stream to the end of
    the last, so output tok/s is the burst's whole output over it (failed streams' tokens included)."""
    ok = [r for r in records if r.status == "ok"]
    tokens = sum(r.output_tokens for r in records)
    return Burst(
        wall_s=wall_s,
        output_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        ttft_p50_s=percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        ttft_p99_s=percentile([r.ttft_s for r in ok if r.ttft_s is not None], 99),
        tpot_p50_s=percentile([r.tpot_s for r in ok if r.tpot_s is not None], 50),
        ok=len(ok),
        failed=len(records) - len(ok),
    )


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_figures(bursts: Sequence[Burst]) -> dict[str, float | None]:
    """A server run's figures: the median of each figure over its bursts."""
    return {f: _median([getattr(b, f) for b in bursts]) for f in FIGURES}


def pair_ratios(vllm: dict[str, float | None], daemon: dict[str, float | None]) -> dict[str, float | None]:
    """daemon / vllm serve per figure: above 1 is better for output tok/s, below 1 for the times."""
    out: dict[str, float | None] = {}
    for f in FIGURES:
        a, b = vllm.get(f), daemon.get(f)
        out[f] = b / a if a and b is not None else None
    return out


def summary(pairs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the pairs of each server's figures and of the pair ratios."""
    return {
        "median": {k: {f: _median([p[k][f] for p in pairs]) for f in FIGURES} for k in KINDS},
        "median_ratio": {f: _median([p["ratio"][f] for p in pairs]) for f in FIGURES},
    }


def order(pair: int) -> tuple[str, str]:
    """vllm serve first in even pairs, the daemon first in odd ones: neither always runs on a box that
    the other just warmed (page cache, CPU frequency)."""
    return (VLLM_SERVE, DAEMON) if pair % 2 == 0 else (DAEMON, VLLM_SERVE)


def server_argv(
    kind: str, engine: dict[str, Any], port: int, admin_port: int, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of ``kind`` with the engine flags: `vllm serve` as the bench starts it, or the
    daemon's drop-in `vllm-autopilot serve` (no TOML file: the daemon's defaults) with ``extra``."""
    flags = [*engine_flags(engine), "--host", HOST, "--port", str(port)]
    if kind == VLLM_SERVE:
        return [sys.executable, "-m", "controller.engine.vllm_serve", "serve", *flags]
    return [sys.executable, "-m", "controller", "serve", *flags, "--admin-port", str(admin_port), *extra]


@contextlib.contextmanager
def flocked(path: Path | None) -> Iterator[None]:
    """An exclusive flock on ``path`` for the block (none without a path)."""
    if path is None:
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def started(
    kind: str, engine: dict[str, Any], log: Path, timeout_s: float, extra: Sequence[str] = ()
) -> Iterator[tuple[str, int, float]]:
    """Start ``kind`` in its own process group; yield (base URL, pid, startup seconds); always stop it."""
    port, admin_port = free_port(), free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        argv = server_argv(kind, engine, port, admin_port, extra)
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    base = f"http://{HOST}:{port}"
    urls = [f"{base}/health"] + ([f"http://{HOST}:{admin_port}/healthz"] if kind == DAEMON else [])
    try:
        yield base, proc.pid, wait_healthy(proc, urls, timeout_s, log)
    finally:
        stop(proc, 60.0)


async def burst(
    target: Target, specs: Sequence[RequestSpec], builder: PromptBuilder, timeout_s: float
) -> Burst:
    start = time.monotonic()
    records = await run_open_loop(target, specs, builder.for_spec, run_start=start, timeout_s=timeout_s)
    return burst_figures(records, time.monotonic() - start)


def specs_for(args: argparse.Namespace, output_tokens: int) -> list[RequestSpec]:
    """``--streams`` streams sent at once; prompt i is the same text in every burst and every run."""
    return [RequestSpec(i, 0.0, args.prompt_tokens, output_tokens) for i in range(args.streams)]


def serve_and_burst(
    kind: str, pair: int, engine: dict[str, Any], args: argparse.Namespace, builder: PromptBuilder
) -> dict[str, Any]:
    """One server's run: start, a warm-up burst, the recorded bursts, stop."""
    log = args.out / "logs" / f"{pair}-{kind}.log"
    specs, warm = specs_for(args, args.output_tokens), specs_for(args, 8)
    extra = (args.daemon_arg or []) if kind == DAEMON else []
    with started(kind, engine, log, args.startup_timeout, extra) as (base, pid, startup_s):
        target = Target(base, str(engine["model"]))
        asyncio.run(burst(target, warm, builder, args.timeout))
        bursts = [asyncio.run(burst(target, specs, builder, args.timeout)) for _ in range(args.bursts)]
        profiled, profile = [], None
        if args.profile_bursts:  # after the recorded ones: sampling slows the server it samples
            stacks = args.out / "profile" / f"{pair}-{kind}.txt"
            with pyspy.record(pid, stacks):
                profiled = [
                    asyncio.run(burst(target, specs, builder, args.timeout))
                    for _ in range(args.profile_bursts)
                ]
            profile = pyspy.summarize(stacks.read_text(), len(specs) * args.profile_bursts)
    failed = sum(b.failed for b in bursts)
    if failed:
        print(f"{kind}: {failed} streams failed; log {log}:\n{log_tail(log, 10)}", file=sys.stderr)
    return {
        "kind": kind,
        "pid": pid,
        "startup_s": startup_s,
        "figures": run_figures(bursts),
        "bursts": [asdict(b) for b in bursts],
        "profiled_bursts": [asdict(b) for b in profiled],
        "profile": profile,
    }


def _cell(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(pairs: Sequence[dict[str, Any]], med: dict[str, Any]) -> str:
    """Per run and median figures, and daemon / vllm serve per pair (markdown)."""
    head = (
        "| pair | server | wall s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
    )

    def row(pair: str, name: str, f: dict[str, Any], ratio: bool = False) -> str:
        if ratio:
            cells = [_cell(f[k], digits=2) + "x" if f[k] is not None else "-" for k in FIGURES]
        else:
            cells = [
                _cell(f["wall_s"], digits=2),
                _cell(f["output_tok_s"]),
                *(_cell(f[k], 1000.0) for k in FIGURES[2:]),
            ]
        return f"| {pair} | {name} | " + " | ".join(cells) + " |"

    lines = [head]
    for p in pairs:
        for kind in p["order"]:
            lines.append(row(str(p["pair"]), kind, p[kind]))
        lines.append(row(str(p["pair"]), "daemon / vllm serve", p["ratio"], ratio=True))
    for kind in KINDS:
        lines.append(row("median", kind, med["median"][kind]))
    lines.append(row("median", "daemon / vllm serve", med["median_ratio"], ratio=True))
    return "\n".join(lines)


def profile_table(pairs: Sequence[dict[str, Any]], top: int = 8) -> str:
    """CPU ms per request of each server's processes in each pair, then the last pair's top functions of
    the daemon's own code (markdown)."""
    lines = ["| pair | server | process | CPU ms / request |", "| --- | --- | --- | ---: |"]
    for p in pairs:
        for kind in p["order"]:
            for role, r in p["runs"][kind]["profile"]["roles"].items():
                lines.append(f"| {p['pair']} | {kind} | {role} | {r['cpu_ms_per_request']:.2f} |")
    last = pairs[-1]["runs"][DAEMON]["profile"]["roles"]
    lines += ["", "| daemon process | function (inclusive) | ms / request |", "| --- | --- | ---: |"]
    for role, r in last.items():
        lines += [f"| {role} | `{label}` | {ms:.3f} |" for label, ms in r["ours"][:top]]
    return "\n".join(lines)


def layers(args: argparse.Namespace) -> int:
    """``--layers``: each layer's CPU per request, and the scheduler subclass's per step."""
    from controller.bench.experiments import frontend_layers

    stacks = frontend_layers.measure_stacks(args.streams, args.output_tokens, args.bursts, args.pairs)
    step = frontend_layers.measure_step(args.streams, steps=2000, rounds=args.pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "argv": sys.argv,
        "streams": args.streams,
        "outputs": args.output_tokens,
        "bursts": args.bursts,
        "rounds": args.pairs,
        "us_per_request": stacks,
        "per_step_us": step,
    }
    (args.out / "layers.json").write_text(json.dumps(result, indent=2) + "\n")
    print(frontend_layers.report(stacks, step, args.streams, args.output_tokens))
    print(f"\nwritten to {args.out / 'layers.json'}")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.pairs < 1 or args.bursts < 1 or args.streams < 1:
        raise ValueError("--pairs, --bursts and --streams must be at least 1")
    if args.layers:
        return layers(args)
    if args.profile_bursts and pyspy.py_spy() is None:
        raise FileNotFoundError("--profile-bursts: py-spy is not installed (pip install py-spy)")
    model = args.model.resolve()
    engine = {"model": str(model), **ENGINE_DEFAULTS, **parse_assignments(args.engine or [], "--engine")}
    builder = PromptBuilder(load_tokenizer(model), seed=0)
    args.out.mkdir(parents=True, exist_ok=True)
    pairs: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        runs: dict[str, Any] = {}
        with flocked(args.lock):
            for kind in order(pair):
                print(f"pair {pair}: {kind}", flush=True)
                runs[kind] = serve_and_burst(kind, pair, engine, args, builder)
        p = {
            "pair": pair,
            "order": list(order(pair)),
            **{k: runs[k]["figures"] for k in KINDS},
            "runs": runs,
            "ratio": pair_ratios(runs[VLLM_SERVE]["figures"], runs[DAEMON]["figures"]),
        }
        pairs.append(p)
        print(
            f"pair {pair}: out tok/s daemon / vllm serve {_cell(p['ratio']['output_tok_s'], digits=2)}x",
            flush=True,
        )
        med = summary(pairs)  # written after every pair: the pairs done survive an interrupted run
        result = {
            "argv": sys.argv,
            "engine": engine,
            "streams": args.streams,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "bursts": args.bursts,
            "pairs": pairs,
            **med,
        }
        (args.out / RESULT).write_text(json.dumps(result, indent=2) + "\n")
    print("\n" + table(pairs, med))
    if args.profile_bursts:
        print("\n" + profile_table(pairs))
    print(f"\nwritten to {args.out / RESULT}")
    return 0
