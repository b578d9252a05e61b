"""Validate the twin against the real CPU engine: one trace window through both, figures side by side.

Run it under the engine lock (it starts the daemon with config.toml's engine settings, static policy)::

    flock /tmp/engine.lock .venv/bin/python bench/validate_sim.py --time-scale 4 8

For each time scale it replays the window of the Azure conversation trace against the daemon (open loop,
streaming ``/v1/completions`` with prompts of exactly the trace's token counts, as token ids), then
simulates the same requests with the profile (static policy, the daemon's admission limit and queue), and
prints throughput and p50/p99 TTFT of both with the ratio twin / real: the twin with the profile's
measured front-end and step-time spread (``[variance]``, seed 0; its p99 over seeds 0-4 too) and the mean
model (constant ``frontend_s``, mean steps). ``--json`` keeps the figures; ``--real-from`` a previous run's
JSON reruns only the twin against that run's real figures (no engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.bench.client import Target, parse_event, payload, pooled_connector  # noqa: E402
from controller.bench.records import RequestRecord, summarize, tpot, write_jsonl  # noqa: E402
from controller.bench.workload import (  # noqa: E402
    RequestSpec,
    clamp_lengths,
    read_azure_trace,
    trace_window,
)
from controller.control.normalize import Normalizer  # noqa: E402
from controller.sim.profile import load_profile  # noqa: E402
from controller.sim.run import ControlSettings, Simulation  # noqa: E402
from policies.base import build_policy  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
RATIO_KEYS = ("throughput_tok_s", "ttft_p50", "ttft_p99", "tpot_p50")
SEEDS = 5
"""The twin with measured spread runs with seeds 0..SEEDS-1: the spread of its own p99."""


async def send(
    session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, start: float
) -> RequestRecord:
    delay = start + spec.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    rng = random.Random(spec.index)
    prompt = [rng.randrange(10, 1000) for _ in range(spec.prompt_tokens)]
    body = payload(Target(url, model), spec, prompt)
    t0 = time.monotonic()
    times: list[float] = []
    tokens = 0
    status = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            status = resp.status
            if status == 200:
                async for raw in resp.content:
                    event = parse_event(raw)
                    if event is None:
                        continue
                    if event.get("choices"):
                        times.append(time.monotonic())
                    if event.get("usage"):  # the final chunk: the true count (chunks may carry several)
                        tokens = int(event["usage"]["completion_tokens"])
    except aiohttp.ClientError as exc:
        return RequestRecord(spec.index, 0, spec.prompt_tokens, spec.output_tokens, 0, t0 - start, "failed",
                             error=str(exc))  # fmt: skip
    if status != 200 or not times:
        kind = "refused" if status in (429, 503) else "failed"
        return RequestRecord(
            spec.index, 0, spec.prompt_tokens, spec.output_tokens, 0, t0 - start, kind, status
        )
    ttft, e2e = times[0] - t0, times[-1] - t0
    tokens = tokens or len(times)
    return RequestRecord(
        spec.index, 0, spec.prompt_tokens, spec.output_tokens, tokens, t0 - start, "ok", 200,
        ttft_s=ttft, tpot_s=tpot(ttft, e2e, tokens), e2e_s=e2e,
    )  # fmt: skip


async def warm_up(session: aiohttp.ClientSession, url: str, model: str) -> None:
    """Every prompt-length bucket and batch size once, unrecorded: the CPU backend prepares kernels for
    new shapes on first use, and the twin models a warm engine."""
    for n, prompt in ((1, 16), (4, 128), (16, 256), (32, 512), (8, 1024), (2, 2000), (64, 64)):
        specs = [RequestSpec(10_000 + k, 0.0, prompt, 16) for k in range(n)]
        await asyncio.gather(*(send(session, url, model, s, time.monotonic()) for s in specs))


async def replay(url: str, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float]:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=pooled_connector(256)) as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        await warm_up(session, url, model)
        start = time.monotonic() + 0.5
        records = await asyncio.gather(*(send(session, url, model, s, start) for s in specs))
        return sorted(records, key=lambda r: r.index), time.monotonic() - start


def simulate(
    specs: list[RequestSpec],
    profile_name: str,
    limit: int,
    max_queue: int,
    seed: int = 0,
    variance: bool = True,
) -> dict[str, Any]:
    profile = load_profile(profile_name)
    seqs = profile.engine.max_num_seqs
    policy = build_policy("static", {}, max_num_seqs=seqs, initial_limit=limit)
    sim = Simulation(
        profile,
        policy,
        Normalizer(limit_max=4096),
        ControlSettings(admission_limit=limit, max_queue=max_queue),
        seed=seed,
        use_variance=variance,
    )
    result = asyncio.run(sim.run(specs))
    return result.summary(None, None)


def twin_rows(specs: list[RequestSpec], real: dict[str, Any], profile: str) -> dict[str, Any]:
    """The twin with the profile's measured spread (seed 0), its p99 TTFT over seeds 0-4, and the
    mean model (no [variance]), each against the real figures."""
    twin = figures(simulate(specs, profile, limit=64, max_queue=1024))
    mean = figures(simulate(specs, profile, limit=64, max_queue=1024, variance=False))
    seeds = [figures(simulate(specs, profile, 64, 1024, seed=k))["ttft_p99"] for k in range(1, SEEDS)]
    return {
        "twin": twin,
        "twin_over_real": ratios(twin, real),
        "twin_p99_over_seeds": [twin["ttft_p99"], *seeds],
        "twin_mean_model": mean,
        "twin_mean_model_over_real": ratios(mean, real),
    }


def ratios(twin: dict[str, Any], real: dict[str, Any]) -> dict[str, float | None]:
    return {k: (twin[k] / real[k] if real.get(k) and twin.get(k) is not None else None) for k in RATIO_KEYS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except (OSError, urllib.error.HTTPError):
        return None


def start_daemon(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    data, admin = free_port(), free_port()
    text = (
        config.read_text().replace("port = 8000", f"port = {data}").replace("port = 9400", f"port = {admin}")
    )
    text = text.replace('model = "models/tiny"', f'model = "{ROOT / "models" / "tiny"}"')
    cfg = Path(tempfile.mkstemp(suffix=".toml")[1])
    cfg.write_text(text)
    proc = subprocess.Popen([sys.executable, "-m", "controller", "serve", "--config", str(cfg)], cwd=ROOT,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    health = f"http://127.0.0.1:{admin}/healthz"
    for _ in range(180):
        if http_status(health) == 200:
            return proc, f"http://127.0.0.1:{data}", health
        if proc.poll() is not None:
            break
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"the daemon did not become healthy; see {log}")


def figures(s: dict[str, Any]) -> dict[str, Any]:
    return {
        k: s.get(k)
        for k in ("requests", "ok", "throughput_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "duration_s")
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--start", type=float, default=0.0)
    p.add_argument("--duration", type=float, default=480.0, help="trace seconds")
    p.add_argument("--time-scale", type=float, nargs="+", default=[4.0])
    p.add_argument("--token-scale", type=float, default=0.25)
    p.add_argument("--profile", default="cpu-tiny")
    p.add_argument("--config", type=Path, default=ROOT / "config.toml")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="write the real runs' records.jsonl here")
    p.add_argument("--real-from", type=Path, default=None,
                   help="a previous run's --json: reuse its real figures (no engine, no lock)")  # fmt: skip
    args = p.parse_args()
    rows = read_azure_trace(args.trace)
    out: list[dict[str, Any]] = []
    previous = {}
    if args.real_from:
        previous = {r["time_scale"]: r["real"] for r in json.loads(args.real_from.read_text())}
    proc = None
    if not args.real_from:
        proc, url, _ = start_daemon(args.config, Path("/tmp/validate_sim_daemon.log"))
    try:
        for ts in args.time_scale:
            window = trace_window(
                rows,
                start_s=args.start,
                duration_s=args.duration,
                time_scale=ts,
                token_scale=args.token_scale,
            )
            specs = clamp_lengths(window, 2048)
            real = previous[ts] if args.real_from else replay_real(url, specs, ts, args.keep)
            out.append({"time_scale": ts, "real": real, **twin_rows(specs, real, args.profile)})
            print(json.dumps(out[-1]), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print_table(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def replay_real(url: str, specs: list[RequestSpec], ts: float, keep: Path | None) -> dict[str, Any]:
    records, duration = asyncio.run(replay(url, specs))
    if keep:
        run = keep / f"real-x{ts:g}"
        run.mkdir(parents=True, exist_ok=True)
        write_jsonl(run / "records.jsonl", records)
    end = max(duration, max((r.arrival_s + (r.e2e_s or 0)) for r in records))
    return figures(summarize(records, end, None, None))


def print_table(out: list[dict[str, Any]]) -> None:
    print("\n| time scale | twin | requests | throughput tok/s real / twin ", end="")
    print("| TTFT p50 ms real / twin | TTFT p99 ms real / twin | TPOT p50 ms real / twin |")
    print("|---" * 7 + "|")
    for row in out:
        for label, twin_key in (("measured spread", "twin"), ("mean model", "twin_mean_model")):
            cells = [f"{row['time_scale']:g}", label, str(row["real"]["requests"])]
            for key, scale in (
                ("throughput_tok_s", 1.0),
                ("ttft_p50", 1e3),
                ("ttft_p99", 1e3),
                ("tpot_p50", 1e3),
            ):
                real, twin, ratio = row["real"][key], row[twin_key][key], row[twin_key + "_over_real"][key]
                cells.append(f"{real * scale:.1f} / {twin * scale:.1f} ({ratio:.2f}x)")
            print("| " + " | ".join(cells) + " |")
    for row in out:
        p99 = [round(v * 1e3, 1) for v in row["twin_p99_over_seeds"]]
        print(f"time scale {row['time_scale']:g}: twin p99 TTFT over seeds 0-{SEEDS - 1}: {p99} ms")


if __name__ == "__main__":
    sys.exit(main())
