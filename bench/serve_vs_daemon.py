"""Benchmark: the vllm-autopilot daemon against plain ``vllm serve`` with the same engine settings.

Run from the repository root:

    .venv/bin/python bench/serve_vs_daemon.py

Each round starts the daemon (a temporary config.toml copied from the default one, on its own ports,
with ``[admission] limit = max_num_seqs`` so that nothing queues in the gate), measures it, stops it,
then does the same for plain ``vllm serve`` (through ``bench/vllm_serve_launcher.py``). The servers
never run at the same time; rounds alternate A, B, A, B. Each server is warmed up, then measured in two
phases over streaming ``/v1/completions``:

- heavy: ``--concurrency`` concurrent requests, ``--requests`` in all, ``--max-tokens`` each
  (``ignore_eos``): output tokens/s and p50/p99 TTFT;
- light: one request at a time, ``--light-requests`` of them, 16 tokens each: p50/p99 TTFT when
  nothing queues.

Targets: the daemon adds < 5 ms p99 TTFT in the light phase and keeps >= 0.98x the throughput of
``vllm serve``. Results go to ``--out`` as JSON; server logs go next to it, under ``logs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.loadgen import PhaseStats, run_phase  # noqa: E402  (needs ROOT on sys.path when run as a script)
from controller.bench.servers import (  # noqa: E402
    engine_flags,
    http_status,
    load_base_config,
    served_model,
    to_toml,
    wait_healthy,
)
from controller.bench.servers import stop as stop_group  # noqa: E402

DAEMON = "daemon"
VLLM_SERVE = "vllm-serve"
HOST = "127.0.0.1"
LIGHT_MAX_TOKENS = 16
TTFT_TARGET_MS = 5.0
THROUGHPUT_TARGET = 0.98


@dataclass
class Run:
    """One server's lifetime: filled in as it starts and stops."""

    pgid: int = 0
    startup_s: float = math.nan
    exit_code: int | None = None
    killed: bool = False


@dataclass(frozen=True)
class Server:
    """How to start one server and where to reach it."""

    name: str
    argv: list[str]
    base_url: str
    health_urls: tuple[str, ...]  # all must answer 200 before the server counts as up


# -- configuration ---------------------------------------------------------------------------------


def daemon_config(base: dict[str, Any], data_port: int, admin_port: int) -> dict[str, Any]:
    """The default config on other ports, with an admission limit that never queues."""
    data = {name: dict(table) for name, table in base.items()}
    data["server"] = {**data.get("server", {}), "host": HOST, "port": data_port}
    data["admin"] = {**data.get("admin", {}), "host": HOST, "port": admin_port}
    data["admission"] = {**data.get("admission", {}), "limit": int(data["engine"]["max_num_seqs"])}
    return data


def make_servers(args: argparse.Namespace, base: dict[str, Any], workdir: Path) -> dict[str, Server]:
    config_path = workdir / "daemon.toml"
    config_path.write_text(to_toml(daemon_config(base, args.daemon_port, args.admin_port)))
    launcher = str(ROOT / "bench" / "vllm_serve_launcher.py")
    serve_args = ["serve", *engine_flags(base["engine"]), "--host", HOST, "--port", str(args.serve_port)]
    serve_args += args.serve_arg
    daemon_url = f"http://{HOST}:{args.daemon_port}"
    serve_url = f"http://{HOST}:{args.serve_port}"
    return {
        DAEMON: Server(
            DAEMON,
            [args.python, "-m", "controller", "serve", "--config", str(config_path)],
            daemon_url,
            (f"http://{HOST}:{args.admin_port}/healthz", f"{daemon_url}/health"),
        ),
        VLLM_SERVE: Server(
            VLLM_SERVE, [args.python, launcher, *serve_args], serve_url, (f"{serve_url}/health",)
        ),
    }


# -- processes -------------------------------------------------------------------------------------


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


@contextmanager
def running(server: Server, log: Path, startup_timeout_s: float, stop_timeout_s: float) -> Iterator[Run]:
    """Start ``server`` in its own process group, yield once healthy, always stop it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            server.argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    run = Run(pgid=proc.pid)
    try:
        run.startup_s = wait_healthy(proc, server.health_urls, startup_timeout_s, log)
        yield run
    finally:
        run.killed = stop_group(proc, stop_timeout_s)
        run.exit_code = proc.returncode


def check_serving(server: Server, model: str) -> None:
    """The OpenAI API answers: /v1/models lists the model, and the health endpoints return 200."""
    try:
        with urllib.request.urlopen(f"{server.base_url}/v1/models", timeout=10) as resp:
            ids = [m["id"] for m in json.load(resp)["data"]]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise RuntimeError(f"{server.name}: GET /v1/models failed: {exc}") from exc
    if model not in ids:
        raise RuntimeError(f"{server.name}: /v1/models lists {ids}, not {model!r}")
    for url in server.health_urls:
        status = http_status(url)
        if status != 200:
            raise RuntimeError(f"{server.name}: GET {url} -> {status}")


# -- measurement -----------------------------------------------------------------------------------


async def measure(server: Server, model: str, args: argparse.Namespace) -> dict[str, PhaseStats]:
    """Warm up, then the heavy and the light phase."""
    warm = await run_phase(server.base_url, model, concurrency=8, requests=16, max_tokens=32)
    if warm.failed:
        raise RuntimeError(f"{server.name}: {warm.failed} warm-up request(s) failed: {warm.first_error}")
    await run_phase(server.base_url, model, concurrency=1, requests=3, max_tokens=LIGHT_MAX_TOKENS)
    heavy = await run_phase(
        server.base_url,
        model,
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
    )
    light = await run_phase(
        server.base_url,
        model,
        concurrency=1,
        requests=args.light_requests,
        max_tokens=LIGHT_MAX_TOKENS,
        prompt_words=args.prompt_words,
    )
    return {"heavy": heavy, "light": light}


def _cpu_seconds_outside(pgid: int) -> dict[int, float]:
    """CPU seconds used so far by each process that is neither this script nor in process group ``pgid``."""
    me = os.getpid()
    seconds: dict[int, float] = {}
    for proc in psutil.process_iter():
        try:
            if proc.pid == me or os.getpgid(proc.pid) == pgid:
                continue
            times = proc.cpu_times()
        except (psutil.Error, ProcessLookupError):
            continue
        seconds[proc.pid] = times.user + times.system
    return seconds


def other_load(before: dict[int, float], after: dict[int, float], duration_s: float) -> float:
    """Cores' worth of CPU that other people's processes used between two snapshots."""
    used = sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items())
    return used / duration_s if duration_s > 0 else 0.0


def measure_with_load(
    server: Server, model: str, args: argparse.Namespace, pgid: int
) -> tuple[dict[str, PhaseStats], float]:
    """``measure`` plus the CPU (in cores) that processes outside the server used meanwhile."""
    before, start = _cpu_seconds_outside(pgid), time.monotonic()
    phases = asyncio.run(measure(server, model, args))
    load = other_load(before, _cpu_seconds_outside(pgid), time.monotonic() - start)
    return phases, load


def run_one(
    server: Server, model: str, round_no: int, args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    log = logs / f"{server.name}-r{round_no}.log"
    print(f"round {round_no}: starting {server.name} (log: {log})", flush=True)
    with running(server, log, args.startup_timeout, args.stop_timeout) as run:
        check_serving(server, model)
        print(f"  healthy after {run.startup_s:.1f} s; measuring", flush=True)
        phases, others = measure_with_load(server, model, args, run.pgid)
    for name, stats in phases.items():
        if stats.failed:
            print(f"  WARNING: {stats.failed} {name} request(s) failed: {stats.first_error}", flush=True)
    print(
        f"  {server.name}: {phases['heavy'].tokens_per_s:.0f} tok/s; stopped with exit code {run.exit_code}"
        + (" (killed)" if run.killed else ""),
        flush=True,
    )
    return {
        "server": server.name,
        "round": round_no,
        "startup_s": run.startup_s,
        "exit_code": run.exit_code,
        "killed": run.killed,
        "other_processes_cores": others,
        **{name: stats.as_dict() for name, stats in phases.items()},
    }


# -- report ----------------------------------------------------------------------------------------

_METRICS = (
    ("tok/s", "heavy", "tokens_per_s"),
    ("heavy p50 ms", "heavy", "ttft_p50_ms"),
    ("heavy p99 ms", "heavy", "ttft_p99_ms"),
    ("light p50 ms", "light", "ttft_p50_ms"),
    ("light p99 ms", "light", "ttft_p99_ms"),
)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-server means of every metric, and the daemon-vs-vllm-serve ratio and deltas."""
    means = {
        name: {
            f"{phase}_{key}": _mean([r[phase][key] for r in runs if r["server"] == name])
            for _, phase, key in _METRICS
        }
        for name in (DAEMON, VLLM_SERVE)
    }
    d, v = means[DAEMON], means[VLLM_SERVE]
    ratio = d["heavy_tokens_per_s"] / v["heavy_tokens_per_s"] if v["heavy_tokens_per_s"] else math.nan
    deltas = {f"{p}_{k}_delta_ms": d[f"{p}_{k}"] - v[f"{p}_{k}"] for _, p, k in _METRICS[1:]}
    return {
        "means": means,
        "throughput_ratio": ratio,
        **deltas,
        "meets_throughput_target": ratio >= THROUGHPUT_TARGET,
        "meets_ttft_target": deltas["light_ttft_p99_ms_delta_ms"] < TTFT_TARGET_MS,
    }


def _row(label: str, values: list[float], failed: str = "") -> str:
    return f"{label:<18}" + "".join(f"{v:>14.1f}" for v in values) + f"{failed:>9}"


def describe_workload(args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    prompt = _mean([r["heavy"]["mean_prompt_tokens"] for r in runs])
    return (
        f"heavy: {args.requests} streaming requests, {args.concurrency} concurrent, "
        f"prompt {prompt:.0f} tokens, {args.max_tokens} output tokens (ignore_eos); "
        f"light: {args.light_requests} requests one at a time, "
        f"{LIGHT_MAX_TOKENS} output tokens. TTFT in ms."
    )


def format_table(runs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    labels = "".join(f"{label:>14}" for label, _, _ in _METRICS)
    header = f"{'run':<18}{labels}{'failed':>9}{'others':>9}"
    lines = [header, "-" * len(header)]
    for r in runs:
        failed = str(r["heavy"]["failed"] + r["light"]["failed"])
        row = _row(f"{r['server']} r{r['round']}", [r[p][k] for _, p, k in _METRICS], failed)
        lines.append(f"{row}{r['other_processes_cores']:>9.2f}")
    lines.append("-" * len(header))
    for name in (DAEMON, VLLM_SERVE):
        lines.append(_row(f"mean {name}", [summary["means"][name][f"{p}_{k}"] for _, p, k in _METRICS]))
    ok = {True: "ok", False: "MISSED"}
    lines += [
        f"others: cores used by processes outside the server and this script while it was measured "
        f"(this machine has {os.cpu_count()}); rows with others > 0.1 ran on a shared CPU and are noisy.",
        "",
        f"daemon / vllm-serve throughput: {summary['throughput_ratio']:.3f}x "
        f"(target >= {THROUGHPUT_TARGET}: {ok[summary['meets_throughput_target']]})",
        f"daemon - vllm-serve light p99 TTFT: {summary['light_ttft_p99_ms_delta_ms']:+.2f} ms "
        f"(target < {TTFT_TARGET_MS} ms: {ok[summary['meets_ttft_target']]}); "
        f"light p50 {summary['light_ttft_p50_ms_delta_ms']:+.2f} ms",
        f"daemon - vllm-serve heavy TTFT: p50 {summary['heavy_ttft_p50_ms_delta_ms']:+.1f} ms, "
        f"p99 {summary['heavy_ttft_p99_ms_delta_ms']:+.1f} ms",
    ]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32, help="concurrent requests in the heavy phase")
    p.add_argument("--requests", type=int, default=128, help="requests in the heavy phase")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per heavy request")
    p.add_argument("--light-requests", type=int, default=100, help="sequential requests in the light phase")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs the daemon, then vllm serve")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_vs_daemon.json")
    p.add_argument("--prompt-words", type=int, default=40, help="prompt length (about 1 token per word)")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for vllm serve (repeatable), e.g. --serve-arg=--disable-uvicorn-access-log",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter that runs both servers")
    p.add_argument("--config", type=Path, default=ROOT / "config.toml", help="config to copy the engine from")
    p.add_argument("--daemon-port", type=int, default=8100)
    p.add_argument("--admin-port", type=int, default=9500)
    p.add_argument("--serve-port", type=int, default=8200)
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for health")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds after SIGTERM before SIGKILL")
    return p.parse_args(argv)


def ensure_model(args: argparse.Namespace, engine: dict[str, Any]) -> None:
    model = Path(engine["model"])
    if model.is_absolute() and not model.exists():
        cmd = [args.python, "-m", "controller", "make-tiny-model", str(model), "--if-missing"]
        subprocess.run(cmd, cwd=ROOT, check=True)


def _interrupt_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the ``running`` block, which stops its server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    busy = [p for p in (args.daemon_port, args.admin_port, args.serve_port) if not port_free(p)]
    if busy:
        print(f"ports already in use: {busy}; pick others with --daemon-port/--admin-port/--serve-port")
        return 2
    base = load_base_config(args.config)
    ensure_model(args, base["engine"])
    model = served_model(base["engine"])
    logs = args.out.parent / "logs"
    runs: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="serve_vs_daemon-") as tmp:
            servers = make_servers(args, base, Path(tmp))
            for round_no in range(1, args.rounds + 1):
                for name in (DAEMON, VLLM_SERVE):
                    runs.append(run_one(servers[name], model, round_no, args, logs))
    except KeyboardInterrupt:
        print("interrupted; the running server was stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    summary = summarize_runs(runs)
    print("\n" + describe_workload(args, runs) + "\n\n" + format_table(runs, summary))
    result = {
        "argv": sys.argv,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine": base["engine"],
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
