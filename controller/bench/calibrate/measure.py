"""The calibration's measurements: controlled loads against a running server, timed from the client.

Prefill-heavy and decode-heavy rows for the fit (``fit.py``), the front-end probes and the step gaps for
the spread tables, and the open-loop load phases whose replay through the twin gives the front end under
load (``run.py``: the method, and what is made of these).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from controller.bench.calibrate.fit import COLUMNS, Sample, fit, median_sample
from controller.bench.servers import Launched, ServerSpec, launched, load_base_config
from controller.load.client import Target, payload, pooled_connector, post
from controller.load.workload import RequestSpec
from controller.profiles.load import EngineLimits
from policies.cost import StepCoefficients


class Server:
    def __init__(self, session: aiohttp.ClientSession, url: str, vocab: int, seed: int) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.model = ""

    async def model_info(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/v1/models") as resp:
            resp.raise_for_status()
            data = (await resp.json())["data"][0]
        self.model = str(data["id"])
        return dict(data)

    async def cache_info(self, metrics_url: str | None) -> dict[str, str]:
        """Labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...); {} when absent."""
        try:
            async with self.session.get(metrics_url or f"{self.url}/metrics") as resp:
                text = await resp.text()
        except aiohttp.ClientError:
            return {}
        match = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.MULTILINE)
        return dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) if match else {}

    async def stream(self, prompt_tokens: int, max_tokens: int) -> tuple[float, list[float]]:
        """Send one request; (time sent, arrival time of each streamed token chunk), monotonic clock.
        Raises for an HTTP error and re-raises a transport error."""
        prompt = [self.rng.randrange(10, self.vocab) for _ in range(prompt_tokens)]
        body = payload(Target(self.url, self.model), RequestSpec(0, 0.0, prompt_tokens, max_tokens), prompt)
        answer = await post(self.session, f"{self.url}/v1/completions", body)
        if answer.failure is not None:
            raise answer.failure
        if answer.status != 200:
            raise RuntimeError(f"{self.url}: HTTP {answer.status}: {answer.body[:200]}")
        return answer.sent_mono, answer.chunk_mono


async def decode_samples(server: Server, n: int, prompt: int, out: int) -> tuple[list[Sample], list[float]]:
    """``n`` concurrent requests of ``out`` tokens: one sample, the median over the requests of their
    mean step (first to last token over ``out - 1`` steps), and one stream's step ratios. Timing whole
    decodes rather than single chunk gaps keeps the sample right when the server coalesces several
    tokens into one chunk."""
    results = await asyncio.gather(*(server.stream(prompt, out) for _ in range(n)))
    steps = [(times[-1] - times[0]) / (out - 1) for _, times in results if len(times) >= 2]
    if not steps:
        return [], []
    context = prompt + out // 2
    return [Sample("decode", 1, 0, n, n * context, statistics.median(steps))], step_ratios(results, out)


def step_ratios(results: Sequence[tuple[float, list[float]]], out: int, min_gaps: int = 8) -> list[float]:
    """The first stream with one chunk per token: its gaps once every stream has its first token,
    each over their mean (see the module docstring); [] when no stream qualifies."""
    lockstep_from = max((times[0] for _, times in results if times), default=math.inf)
    for _, times in results:
        if len(times) != out:
            continue  # coalesced chunks: one gap would span several steps
        gaps = [b - a for a, b in itertools.pairwise(times) if a >= lockstep_from]
        mean = sum(gaps) / len(gaps) if gaps else 0.0
        if len(gaps) >= min_gaps and mean > 0:
            return [g / mean for g in gaps]
    return []


async def frontend_ttfts(server: Server, probes: int, prompt: int) -> list[float]:
    """TTFTs of ``probes`` single ``max_tokens = 1`` requests, one at a time, 0-20 ms apart."""
    ttfts = []
    for _ in range(probes):
        await asyncio.sleep(server.rng.uniform(0.0, 0.02))
        t0, times = await server.stream(prompt, 1)
        ttfts.append(times[0] - t0)
    return ttfts


async def prefill_sample(server: Server, prompt: int, budget: int) -> Sample:
    t0, times = await server.stream(prompt, 1)
    steps = max(1, math.ceil(prompt / budget))
    kv = sum(min(prompt, (k + 1) * budget) for k in range(steps))
    return Sample("prefill", steps, prompt, 0, kv, times[0] - t0)


@dataclass(frozen=True)
class CalibrationPlan:
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_prompts: tuple[int, ...] = (16, 512)
    output_tokens: int = 96
    prefill_prompts: tuple[int, ...] = (32, 128, 256, 512, 1024, 1536)
    repeats: int = 5
    frontend_probes: int = 200
    """Single light-load requests whose TTFT spread gives the front-end table (0: no tables)."""
    frontend_prompt: int = 32
    load_in_flight: tuple[int, ...] = (2, 6, 12, 24)
    """In-flight targets of the open-loop phases that measure the front end under load (empty: none)."""
    load_phase_s: float = 30.0
    """Seconds of arrivals per phase at least: a phase must last long enough to meet the server's
    occasional stalls as often as a real run does, or the tables' tails are noise."""
    load_requests: int = 300
    """Requests per phase at least (a low-load phase lasts longer)."""


@dataclass(frozen=True)
class LoadPhase:
    """One open-loop phase: what was sent and what came back."""

    specs: tuple[RequestSpec, ...]
    """As sent: ``arrival_s`` is the measured send time, seconds after the phase's start."""
    ttft_s: dict[int, float]
    """Measured TTFT by request index (failed requests are absent)."""
    e2e_s: dict[int, float]
    """Measured send-to-last-token time by request index."""


@dataclass
class Measurements:
    samples: list[Sample]
    """The fit's rows."""
    step_ratios: list[float]
    """Single decode steps over their stream's mean step."""
    frontend_ttfts: list[float]
    """TTFTs of the front-end probes (``plan.frontend_prompt`` tokens each)."""
    frontend_prompt: int
    load_phases: list[LoadPhase] = field(default_factory=list)
    """The open-loop phases under load (``plan.load_in_flight``)."""


async def measure(
    url: str, plan: CalibrationPlan, limits: EngineLimits, vocab: int, seed: int, log: Any = print
) -> Measurements:
    samples: list[Sample] = []
    ratios: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=pooled_connector(256)) as session:
        server = Server(session, url, vocab, seed)
        await server.model_info()
        for prompt in plan.prefill_prompts:  # warm up: the CPU backend prepares kernels per shape
            if prompt + 1 <= limits.max_model_len:
                await server.stream(prompt, 4)
        ttfts = await frontend_ttfts(server, plan.frontend_probes, plan.frontend_prompt)
        if ttfts:
            log(f"front end: {len(ttfts)} probes, TTFT median {statistics.median(ttfts) * 1e3:.2f} ms")
        for prompt in plan.prefill_prompts:
            if prompt + 1 > limits.max_model_len:
                continue
            prefills = [
                await prefill_sample(server, prompt, limits.max_num_batched_tokens)
                for _ in range(plan.repeats)
            ]
            samples.append(median_sample(prefills))
            log(f"prefill P={prompt}: ttft {samples[-1].seconds:.4f} s")
        for prompt in plan.decode_prompts:
            for n in plan.concurrency:
                if n > limits.max_num_seqs or prompt + plan.output_tokens > limits.max_model_len:
                    continue
                got: list[Sample] = []
                for _ in range(plan.repeats):
                    rows, gaps = await decode_samples(server, n, prompt, plan.output_tokens)
                    got += rows
                    ratios += gaps
                if got:
                    samples.append(median_sample(got))
                    log(f"decode N={n} P={prompt}: step {samples[-1].seconds * 1e3:.2f} ms")
        phases = []
        if plan.load_in_flight and len(samples) >= len(COLUMNS):
            cost, frontend_s, _ = fit(samples)
            for k, target in enumerate(plan.load_in_flight):
                specs = load_workload(
                    cost,
                    limits,
                    target,
                    plan.load_requests,
                    server.rng,
                    plan.load_phase_s,
                    max_prompt=max(plan.prefill_prompts),
                    frontend_s=frontend_s,
                )
                phases.append(await load_phase(server, specs))
                ok = len(phases[-1].ttft_s)
                log(f"load phase {k + 1}: {len(specs)} requests for ~{target} in flight, {ok} answered")
                await asyncio.sleep(1.0)
    return Measurements(samples, ratios if plan.frontend_probes else [], ttfts, plan.frontend_prompt, phases)


def load_workload(
    cost: StepCoefficients,
    limits: EngineLimits,
    in_flight: int,
    requests: int,
    rng: random.Random,
    seconds: float = 0.0,
    max_prompt: int = 1024,
    frontend_s: float = 0.0,
) -> list[RequestSpec]:
    """Poisson arrivals, at least ``requests`` of them and for at least ``seconds``, at the rate that
    keeps ``in_flight`` requests in flight by Little's law with the fitted model: rate = in_flight /
    (``frontend_s`` + prefill + mean output * decode step). Prompts stay within ``max_prompt``, the
    longest prefill point fitted: past it a CPU's prefill costs more a token than the linear fit says
    (attention), and that error, compounded by the queue, would read as seconds of front-end delay."""
    hi = max(17, min(1024, max_prompt, limits.max_model_len // 2))
    mean_prompt, mean_out = (hi - 16) / math.log(hi / 16), 68.0
    decode = cost.step_s(0, in_flight, int(in_flight * (mean_prompt + mean_out / 2)))
    latency = frontend_s + cost.step_s(int(mean_prompt), 0, int(mean_prompt)) + mean_out * decode
    rate = in_flight / latency
    specs: list[RequestSpec] = []
    t = rng.expovariate(rate)
    while len(specs) < requests or t < seconds:
        prompt = int(math.exp(rng.uniform(math.log(16), math.log(hi))))
        out = max(1, min(rng.randint(8, 128), limits.max_model_len - prompt))
        specs.append(RequestSpec(len(specs), t, prompt, out))
        t += rng.expovariate(rate)
    return specs


async def load_phase(server: Server, specs: Sequence[RequestSpec]) -> LoadPhase:
    """Send ``specs`` open loop (each at its ``arrival_s``) and record what each one got."""
    start = time.monotonic() + 0.05

    async def one(spec: RequestSpec) -> tuple[RequestSpec, float, list[float]]:
        await asyncio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
        try:
            t0, times = await server.stream(spec.prompt_tokens, spec.output_tokens)
        except (aiohttp.ClientError, RuntimeError):
            return spec, time.monotonic(), []
        return spec, t0, times

    results = await asyncio.gather(*(one(s) for s in specs))
    sent = tuple(replace(spec, arrival_s=t0 - start) for spec, t0, _ in results)
    ok = [(spec, t0, times) for spec, t0, times in results if times]
    return LoadPhase(
        sent,
        {spec.index: times[0] - t0 for spec, t0, times in ok},
        {spec.index: times[-1] - t0 for spec, t0, times in ok},
    )


async def engine_limits(
    url: str, metrics_url: str | None, overrides: dict[str, Any]
) -> tuple[EngineLimits, int]:
    """The server's limits (KV blocks from /metrics, max_model_len from /v1/models) and a vocab bound."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        server = Server(session, url, 1000, 0)
        info = await server.model_info()
        cache = await server.cache_info(metrics_url)
    values: dict[str, Any] = {}
    if "max_model_len" in info:
        values["max_model_len"] = int(info["max_model_len"])
    if cache.get("block_size", "").isdigit() and cache.get("num_gpu_blocks", "").isdigit():
        values["block_size"] = int(cache["block_size"])
        values["kv_cache_tokens"] = int(cache["block_size"]) * int(cache["num_gpu_blocks"])
    values.update({k: v for k, v in overrides.items() if v is not None})
    limits = EngineLimits(**values)
    limits.validate(f"calibration of {url}")
    return limits, 1000


ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy")
"""The profile's ``[engine]`` settings a daemon's config file sets (``--config``'s daemon runs with them)."""


def config_limits(config: Path, flags: dict[str, Any]) -> dict[str, Any]:
    """The engine limits to record for our daemon started with ``config``: what its ``[engine]`` sets,
    under the command line's ``flags`` (a flag given wins). Without this the profile recorded the
    flags' defaults (``max_num_seqs`` 256, ``fcfs``) for a daemon that ran 64 under ``priority``,
    and the calibration measured decode batches the daemon's cap never runs."""
    engine = load_base_config(config)["engine"]
    return {
        **{k: engine[k] for k in ENGINE_KEYS if k in engine},
        **{k: v for k, v in flags.items() if v is not None},
    }


@contextmanager
def our_daemon(config: Path, workdir: Path) -> Iterator[Launched]:
    """Our daemon with ``config``'s tables (its own ``[control]``, params included) on free ports,
    started and stopped by the bench's one launcher; its log goes to ``workdir``."""
    base = load_base_config(config)
    spec = ServerSpec("daemon", "daemon", engine=base["engine"], control=dict(base.get("control", {})))
    # A real model's first build compiles for minutes on a small CPU host (4 on the dev box).
    with launched(spec, base, workdir, startup_timeout_s=900.0) as server:
        yield server
