"""``vllm-autopilot gpu-check``: start the daemon on the operator's config and check, in order, what a
GPU host must show on day one; print a pass/fail table with the figures and write it as JSON.

The checks (docs/gpu.md):

- ``engine_path``: an engine serves, and its EngineCore was spawned (exec'd: its auxiliary vector is
  not the daemon's), not forked from the daemon;
- ``daemon_cuda_context``: the daemon's own process holds no CUDA context (NVML's compute processes;
  skipped without NVML);
- ``restart_survived``: a restart of the live engine (a reload with ``restart_on_reload`` and a new
  ``seed``) retires the engine with SIGTERM, and the daemon serves on: a forked engine's SIGTERM once
  stopped the daemon at its first restart;
- ``memory_restart_co_tenant``: a co-tenant process (torch) takes all but ``CO_TENANT_LEAVES_BYTES``
  of the GPU's free memory while the daemon serves; the guard must restart the engine for memory
  (``/state``'s last restart: ``gpu_memory_low`` or ``cuda_oom``) and a request must be served after;
- ``guard_at_util_0_97``: a daemon at ``gpu_memory_utilization`` 0.97 under a closed-loop load makes
  no memory restart within ``GUARD_WATCH_S`` (vLLM's own reservation is not a risk);
- ``parity_with_vllm_serve``: the same fixed closed-loop load against the daemon and then against
  ``vllm serve`` at the same [engine] settings; the daemon's output tokens/s within ``PARITY_TOLERANCE``;
- ``tp2_dp2_restarts``: with two GPUs, ``restart_survived`` at tensor parallel 2 and at data parallel 2;
- ``clean_stop``: SIGTERM ends the daemon with status 0, no process of its group left (and none on
  the GPU).

Without a GPU (no NVML) the GPU checks are skipped with the reason; with one GPU, ``tp2_dp2_restarts``.
The judgement of each check is a function of the answers read (``judge_*``), tested with fakes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from controller.bench.runner import Endpoints, RunConfig, run_workload
from controller.bench.servers import (
    Launched,
    ServerSpec,
    daemon_config,
    launched,
    load_base_config,
    served_model,
    to_toml,
)
from controller.load.client import Target
from controller.load.prompts import PromptBuilder, load_tokenizer
from controller.load.workload import RequestSpec

PASS, FAIL, SKIP = "pass", "fail", "skip"

GPU_CHECKS = (
    ("memory_restart_co_tenant", "a memory restart forced by a co-tenant allocation", 1),
    ("guard_at_util_0_97", "the guard at gpu_memory_utilization 0.97 under load", 1),
    ("parity_with_vllm_serve", "throughput within 5 % of vllm serve at the same settings", 1),
    ("tp2_dp2_restarts", "restarts at tensor parallel 2 and data parallel 2", 2),
)
"""The checks that need GPUs: name, what it shows, how many GPUs."""

MEMORY_RESTART_REASONS = frozenset({"gpu_memory_low", "cuda_oom"})
"""The guard's restart reasons for GPU memory (``lifecycle/guard.MEMORY_REASONS``, the GPU's)."""
CO_TENANT_LEAVES_BYTES = 256 << 20
"""What the co-tenant leaves free: below the guard's margin at any utilization (at least half of a
GPU's 3 % less the contexts, ``lifecycle/memory.gpu_margin_bytes``)."""
CO_TENANT = """
import sys, torch
free, _ = torch.cuda.mem_get_info()
held = torch.empty(max(free - int(sys.argv[1]), 0), dtype=torch.uint8, device="cuda")
print(held.numel(), flush=True)
sys.stdin.read()
"""
"""The co-tenant: takes the free memory of the first visible GPU (the engine's at TP 1) but
``argv[1]`` bytes, says how much, and holds it until its stdin closes."""
MEMORY_RESTART_TIMEOUT_S = 300.0
HIGH_UTIL = 0.97
GUARD_WATCH_S = 60.0
"""How long the daemon at ``HIGH_UTIL`` must go without a memory restart, the load included."""
PARITY_TOLERANCE = 0.05
LOAD_REQUESTS, LOAD_CONCURRENCY, LOAD_PROMPT, LOAD_OUTPUT = 256, 32, 256, 128
"""The fixed closed-loop load of the GPU checks: every request at once, at most 32 in flight."""

RESTART_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """``PASS``, ``FAIL`` or ``SKIP``."""
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


def nvml_pids() -> set[int] | None:
    """The pids NVML lists as compute processes on any GPU; None without NVML (a CPU host)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no GPU: the CPU case
        return None
    pids: set[int] = set()
    for i in range(int(pynvml.nvmlDeviceGetCount())):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        pids |= {int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    return pids


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10.0) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return int(resp.status), json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")


def _generation(server: Launched) -> int:
    assert server.state_url is not None
    return int(_get(server.state_url)["engine"]["generation"])


def _completion(server: Launched) -> int:
    body = {"model": served_model(server.spec.engine), "prompt": "Hello", "max_tokens": 4}
    status, _ = _post(f"{server.base_url}/v1/completions", body)
    return status


def engine_processes(pid: int) -> list[psutil.Process]:
    """The daemon's children that run vLLM's engine (its EngineCore and workers)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "resource_tracker" not in " ".join(_cmdline(c))]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return list(proc.cmdline())
    except psutil.Error:
        return []


def _auxv(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/auxv").read_bytes()
    except OSError:
        return None


def spawned(proc: psutil.Process, parent_pid: int) -> bool | None:
    """True when ``proc`` was exec'd (spawned), False when it was forked from ``parent_pid``: the
    kernel's auxiliary vector is written at exec, so a forked child keeps its parent's (its random
    bytes' address included) and an exec'd one has its own; None where /proc cannot tell (vLLM's
    process titles overwrite the command line and the environment)."""
    own, parent = _auxv(proc.pid), _auxv(parent_pid)
    if own is None or parent is None:
        return None
    return own != parent


def check_engine_path(server: Launched) -> Check:
    generation = _generation(server)
    procs = engine_processes(server.pid)
    methods = [spawned(p, server.pid) for p in procs]
    figures = {"generation": generation, "engine_processes": len(procs), "spawned": methods}
    if generation < 1 or not procs:
        return Check("engine_path", FAIL, "no engine process serves", figures)
    if any(m is False for m in methods):
        return Check("engine_path", FAIL, "an engine process was forked from the daemon", figures)
    return Check("engine_path", PASS, f"{len(procs)} engine process(es), spawned", figures)


def check_daemon_cuda_context(server: Launched) -> Check:
    pids = nvml_pids()
    if pids is None:
        return Check("daemon_cuda_context", SKIP, "no NVML on this host")
    if server.pid in pids:
        return Check("daemon_cuda_context", FAIL, "the daemon's own process holds a CUDA context")
    return Check("daemon_cuda_context", PASS, "the daemon's own process holds no CUDA context")


def check_restart_survived(server: Launched, base: dict[str, Any]) -> Check:
    """Rewrite the daemon's config with a new engine ``seed`` and ``restart_on_reload``, reload, wait
    for the next engine generation, then ask it for a completion."""
    assert server.config_path is not None and server.state_url is not None
    before = _generation(server)
    engine = {**server.spec.engine, "seed": int(server.spec.engine.get("seed") or 0) + 1}
    spec = ServerSpec(server.spec.name, "daemon", engine, server.spec.control, server.spec.admission)
    ports = [int(u.rsplit(":", 1)[1].split("/", 1)[0]) for u in (server.base_url, server.state_url)]
    config = daemon_config(base, spec, ports[0], ports[1])
    config["engine"]["restart_on_reload"] = True
    server.config_path.write_text(to_toml(config))
    admin = server.state_url.rsplit("/", 1)[0]
    t0 = time.monotonic()
    status, answer = _post(f"{admin}/reload", {})
    if status != 200:
        return Check("restart_survived", FAIL, f"the reload was refused ({status}): {answer}")
    while time.monotonic() - t0 < RESTART_TIMEOUT_S and server.alive():
        try:
            if _generation(server) > before:
                break
        except (urllib.error.URLError, OSError, KeyError):
            pass
        time.sleep(1.0)
    restart_s = round(time.monotonic() - t0, 1)
    figures = {"generation_before": before, "restart_s": restart_s}
    if not server.alive():
        return Check("restart_survived", FAIL, "the daemon exited during the restart", figures)
    after = _generation(server)
    figures["generation_after"] = after
    if after <= before:
        return Check("restart_survived", FAIL, f"no new engine within {RESTART_TIMEOUT_S:.0f} s", figures)
    completion = _completion(server)
    figures["completion_status"] = completion
    if completion != 200 or not server.alive():
        return Check("restart_survived", FAIL, "the daemon does not serve after the restart", figures)
    return Check("restart_survived", PASS, f"new engine in {restart_s} s, the daemon serves on", figures)


def check_clean_stop(server: Launched, pids: set[int]) -> Check:
    on_gpu = nvml_pids()
    left = sorted(pids & on_gpu) if on_gpu is not None else []
    figures = {"exit_code": server.exit_code, "killed": server.killed, "left_on_gpu": left}
    if server.exit_code != 0 or server.killed or left:
        return Check("clean_stop", FAIL, "the daemon did not stop cleanly", figures)
    return Check("clean_stop", PASS, "exit 0, no process left", figures)


def visible_gpus(environ: Mapping[str, str] = os.environ) -> int | None:
    """The GPUs the engine may use: those ``CUDA_VISIBLE_DEVICES`` names, else NVML's count; None
    without NVML (a CPU host)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception:  # no library, no driver, no GPU: the CPU case
        return None
    named = environ.get("CUDA_VISIBLE_DEVICES")
    return count if named is None else len([d for d in named.split(",") if d.strip()])


def skipped(gpus: int | None) -> list[Check]:
    """The GPU checks this host cannot run, each with the reason."""
    found = "NVML found none" if gpus is None else f"{gpus} visible"
    return [
        Check(name, SKIP, f"{what}: needs {need} GPU{'s' if need > 1 else ''}, {found}")
        for name, what, need in GPU_CHECKS
        if (gpus or 0) < need
    ]


def _state(server: Launched) -> dict[str, Any]:
    assert server.state_url is not None
    state: dict[str, Any] = _get(server.state_url)
    return state


def _restart_seen(state: dict[str, Any]) -> tuple[int, str | None]:
    """The engine's generation and the reason of the guard's last restart in a ``/state`` answer."""
    last = (state.get("guard") or {}).get("last_restart") or {}
    return int(state["engine"]["generation"]), last.get("reason")


def judge_memory_restart(before: dict[str, Any], after: dict[str, Any], completion: int) -> Check:
    """``before``/``after``: ``/state`` when the co-tenant took the memory and once the watch ended;
    ``completion``: the status of a request sent after."""
    gen_before, _ = _restart_seen(before)
    gen_after, reason = _restart_seen(after)
    figures = {
        "generation_before": gen_before,
        "generation_after": gen_after,
        "reason": reason,
        "util_before": before["engine"].get("gpu_memory_utilization"),
        "util_after": after["engine"].get("gpu_memory_utilization"),
        "completion_status": completion,
    }
    name = "memory_restart_co_tenant"
    if gen_after <= gen_before or reason not in MEMORY_RESTART_REASONS:
        return Check(name, FAIL, "the guard made no memory restart while the co-tenant held the GPU", figures)
    if completion != 200:
        return Check(name, FAIL, "the daemon does not serve after the memory restart", figures)
    return Check(name, PASS, f"memory restart ({reason}), served after it", figures)


def judge_high_util(before: dict[str, Any], after: dict[str, Any], load: dict[str, Any]) -> Check:
    """No engine restart of any kind between ``before`` and ``after`` (``/state``), and the load
    (the runner's summary) served without failures."""
    gen_before, _ = _restart_seen(before)
    gen_after, reason = _restart_seen(after)
    figures = {
        "restarts": gen_after - gen_before,
        "reason": reason,
        "ok": load["ok"],
        "failed": load["failed"],
    }
    name = "guard_at_util_0_97"
    if gen_after != gen_before:
        return Check(name, FAIL, f"the engine restarted ({reason}) at util {HIGH_UTIL}", figures)
    if load["failed"] or not load["ok"]:
        return Check(name, FAIL, "the load was not served", figures)
    return Check(name, PASS, f"no restart in {GUARD_WATCH_S:.0f} s under load", figures)


def judge_parity(daemon: dict[str, Any], serve: dict[str, Any]) -> Check:
    """The daemon's output tokens/s against ``vllm serve``'s, for the same load (runner summaries)."""
    ours, theirs = float(daemon["throughput_tok_s"]), float(serve["throughput_tok_s"])
    ratio = ours / theirs if theirs > 0 else 0.0
    figures = {"daemon_tok_s": round(ours, 1), "vllm_serve_tok_s": round(theirs, 1), "ratio": round(ratio, 3)}
    if daemon["failed"] or serve["failed"] or not theirs:
        return Check("parity_with_vllm_serve", FAIL, "a load was not wholly served", figures)
    if ratio < 1.0 - PARITY_TOLERANCE:
        return Check("parity_with_vllm_serve", FAIL, f"{ratio:.2f}x vllm serve", figures)
    return Check("parity_with_vllm_serve", PASS, f"{ratio:.2f}x vllm serve", figures)


def judge_parallel_restarts(results: dict[str, Check]) -> Check:
    """``restart_survived`` at each parallel setting, as one check."""
    figures = {kind: {"status": c.status, "detail": c.detail, **c.figures} for kind, c in results.items()}
    failed = [kind for kind, c in results.items() if c.status != PASS]
    if failed:
        return Check("tp2_dp2_restarts", FAIL, f"failed at {', '.join(failed)}", figures)
    return Check("tp2_dp2_restarts", PASS, "the daemon survived a restart at " + ", ".join(results), figures)


def closed_loop(server: Launched, out: Path, label: str) -> dict[str, Any]:
    """The fixed closed-loop load against ``server`` through the bench's runner; its summary."""
    engine = server.spec.engine
    specs = [
        RequestSpec(index=i, arrival_s=0.0, prompt_tokens=LOAD_PROMPT, output_tokens=LOAD_OUTPUT)
        for i in range(LOAD_REQUESTS)
    ]
    builder = PromptBuilder(load_tokenizer(Path(engine["model"])), seed=0)
    cfg = RunConfig(out / label, progress=False, concurrency=LOAD_CONCURRENCY)
    endpoints = Endpoints(server.metrics_url, server.state_url)
    target = Target(server.base_url, served_model(engine))
    return asyncio.run(run_workload(target, specs, builder, cfg, endpoints, label=label))


def check_memory_restart(server: Launched) -> Check:
    """A co-tenant takes the GPU's free memory; watch ``/state`` for the guard's restart, then ask
    for a completion; the co-tenant lets go at the end."""
    argv = [sys.executable, "-c", CO_TENANT, str(CO_TENANT_LEAVES_BYTES)]
    co_tenant = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert co_tenant.stdout is not None
        held = co_tenant.stdout.readline().strip()
        if not held:
            return Check(
                "memory_restart_co_tenant", FAIL, "the co-tenant did not allocate (torch with CUDA?)"
            )
        before = _state(server)
        t0 = time.monotonic()
        after = before
        while time.monotonic() - t0 < MEMORY_RESTART_TIMEOUT_S and server.alive():
            time.sleep(2.0)
            with contextlib.suppress(urllib.error.URLError, OSError):
                after = _state(server)
            if _restart_seen(after)[0] > _restart_seen(before)[0] and not after["guard"]["restarting"]:
                break
        check = judge_memory_restart(before, after, _completion(server) if server.alive() else 0)
        return Check(
            check.name, check.status, check.detail, {**check.figures, "co_tenant_bytes": held.decode()}
        )
    finally:
        try:
            co_tenant.communicate(timeout=60.0)  # closes its stdin: it lets go and exits
        except subprocess.TimeoutExpired:
            co_tenant.kill()
            co_tenant.wait()


def check_high_util(base: dict[str, Any], out: Path, startup_timeout_s: float) -> Check:
    engine = {**base["engine"], "gpu_memory_utilization": HIGH_UTIL}
    spec = ServerSpec("gpu-check-util", "daemon", engine, base.get("control", {}), base.get("admission", {}))
    with launched(spec, base, out, startup_timeout_s=startup_timeout_s) as server:
        t0, before = time.monotonic(), _state(server)
        load = closed_loop(server, out, "util-0.97")
        time.sleep(max(0.0, GUARD_WATCH_S - (time.monotonic() - t0)))
        return judge_high_util(before, _state(server), load)


def check_parity(
    daemon_load: dict[str, Any], base: dict[str, Any], out: Path, startup_timeout_s: float
) -> Check:
    """``daemon_load``: the fixed load's summary on the daemon; now the same against vllm serve."""
    spec = ServerSpec("vllm-serve", "vllm-serve", dict(base["engine"]))
    with launched(spec, base, out, startup_timeout_s=startup_timeout_s) as server:
        return judge_parity(daemon_load, closed_loop(server, out, "vllm-serve"))


def check_parallel_restarts(base: dict[str, Any], out: Path, startup_timeout_s: float) -> Check:
    results: dict[str, Check] = {}
    for kind, key in (("tp2", "tensor_parallel_size"), ("dp2", "data_parallel_size")):
        engine = {**base["engine"], key: 2}
        spec = ServerSpec(
            f"gpu-check-{kind}", "daemon", engine, base.get("control", {}), base.get("admission", {})
        )
        try:
            with launched(spec, base, out, startup_timeout_s=startup_timeout_s) as server:
                results[kind] = check_restart_survived(server, base)
        except Exception as exc:  # a start that failed is this setting's failure, not the command's
            results[kind] = Check("restart_survived", FAIL, f"{type(exc).__name__}: {exc}"[:300])
    return judge_parallel_restarts(results)


def run_checks(config: Path, out: Path, startup_timeout_s: float) -> list[Check]:
    base = load_base_config(config)
    spec = ServerSpec(
        "gpu-check", "daemon", dict(base["engine"]), base.get("control", {}), base.get("admission", {})
    )
    gpus = visible_gpus()
    on_gpu = bool(gpus)
    checks: list[Check] = []
    with launched(spec, base, out, startup_timeout_s=startup_timeout_s) as server:
        pids = {server.pid, *(p.pid for p in engine_processes(server.pid))}
        checks.append(check_engine_path(server))
        checks.append(check_daemon_cuda_context(server))
        checks.append(check_restart_survived(server, base))
        daemon_load = closed_loop(server, out, "daemon") if on_gpu else None  # before memory moves
        if on_gpu:
            checks.append(check_memory_restart(server))
        pids |= {p.pid for p in engine_processes(server.pid)}
    checks.append(check_clean_stop(server, pids))
    if daemon_load is not None:  # one GPU: each server in turn
        checks.append(check_high_util(base, out, startup_timeout_s))
        checks.append(check_parity(daemon_load, base, out, startup_timeout_s))
    if (gpus or 0) >= 2:
        checks.append(check_parallel_restarts(base, out, startup_timeout_s))
    return checks + skipped(gpus)


def table(checks: list[Check]) -> str:
    rows = ["| check | result | detail |", "| --- | --- | --- |"]
    rows += [f"| {c.name} | {c.status} | {c.detail} |" for c in checks]
    return "\n".join(rows)


def verdict(checks: list[Check]) -> int:
    """The command's exit status: 1 when any check failed."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def gpu_check_main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    checks = run_checks(args.config, args.out, args.startup_timeout_s)
    print(table(checks))
    report = {"config": str(args.config), "checks": [asdict(c) for c in checks]}
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    return verdict(checks)


def add_gpu_check_parser(sub: Any) -> None:
    p = sub.add_parser(
        "gpu-check",
        help="start the daemon on a config and check the GPU path: engine start method, a restart it "
        "survives, a co-tenant's memory restart, the guard at util 0.97, parity with vllm serve, TP 2 and "
        "DP 2 restarts, a clean stop; prints a table and writes gpu-check.json",
    )
    p.add_argument("--config", type=Path, default=Path("config.toml"), help="the daemon's config file")
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for the logs and the JSON")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.set_defaults(func=gpu_check_main)
