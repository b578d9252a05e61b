"""``bench calibrate``: fit the twin's step-time cost model from a running vLLM server.

Method. The cost model is linear in four step features (``controller/sim/profile.py``)::

    step_s = a + b * prefill_tokens + c * decode_seqs + d * kv_tokens_read

so two kinds of controlled load, measured from the client, give rows of a least-squares problem:

* Decode-heavy: ``N`` concurrent streaming requests of ``P`` prompt tokens and ``T`` forced output
  tokens (``ignore_eos``), sent together. They decode in lockstep, one token each per engine step, so
  a request's first-to-last-token time over ``T - 1`` is the mean step with ``decode_seqs = N`` and
  ``kv_tokens_read ~= N * (P + T / 2)``; the median over the ``N`` requests is the measurement (whole
  decodes, not single chunk gaps: a server may coalesce tokens into one chunk). ``N`` sweeps
  1..max concurrency and ``P`` two prompt lengths, which separates ``c`` (per sequence) from ``d``
  (per KV token).
* Prefill-heavy: one request at a time, ``P`` prompt tokens, ``max_tokens = 1``. Its time to first
  token is ``ceil(P / max_num_batched_tokens)`` steps (chunked prefill) with ``prefill_tokens = P`` and
  the KV read of the chunks, plus the server's fixed HTTP/tokenizer cost, which a fifth column (1 on
  TTFT rows only) absorbs so that it does not leak into ``a``.

Spread (the profile's ``[variance]``, ``controller/sim/quantiles.py``). The fit gives mean costs;
two measurements give their distributions, stored as 101-point quantile tables:

* Front end: ``frontend_probes`` single requests of ``frontend_prompt`` tokens and ``max_tokens = 1``,
  one at a time with a random pause of 0-20 ms between them (light load; the pause keeps them from
  falling into step with the engine's idle loop). Each one's TTFT minus the fitted prefill step
  ``step_s(P, 0, P)`` is one front-end delay: HTTP, tokenizer, the event loops and the first chunk's
  way back, plus that one step's own noise. Delays below 0 are kept at 0.
* Step: from each decode batch, one stream whose chunk count equals its token count (a stream with
  fewer chunks had tokens coalesced and is skipped), its inter-token gaps after every request of the
  batch had its first token (pure lockstep decode: one gap is one step), each over the stream's mean
  gap. Normalising by the mean, not the median, keeps the fit's mean step the twin's mean step.
  Gaps are seen from the client, so the table also holds the output path's jitter.

* Front end under load (``[variance.frontend_loaded]``): the light-load probes miss what a busy
  server adds (its event loop streams every running request's tokens and takes new requests one at
  a time, and on a small host it shares the CPU with the engine). So the calibration ends with
  open-loop phases of Poisson arrivals (prompts log-uniform in 16-1024 tokens, outputs 8-128; at
  least ``load_phase_s`` seconds and ``load_requests`` requests each), each at the rate that should
  keep ``load_in_flight[k]`` requests in flight by the fitted model.
  The twin then replays each phase as it was sent (mean model, no front end): a request's delay is
  its measured TTFT minus the twin's TTFT for it, i.e. everything the engine model does not
  explain. Delays are binned by how many requests were in flight when the request was sent (from
  the measured send and end times; the first ``LOAD_RAMP_S`` of a phase are not recorded, the load
  is still ramping up) into one quantile table per level (1, 2, 4, 8, ...; a level
  with fewer than ``LOAD_MIN_SAMPLES`` delays joins its neighbour).

Each point is measured ``repeats`` times after a warm-up of every prompt length, and the median of
the repeats is its row (a shared machine gives outliers). Prompts are random token ids (a new draw
per request, so a prefix cache cannot hit). The fit is non-negative least squares
(``numpy.linalg.lstsq`` with an active set: a negative coefficient is fixed at 0 and the rest
refitted), since no step feature makes a step faster. The KV capacity and block size come from
vLLM's ``vllm:cache_config_info`` metric on ``/metrics`` when the server exposes it; the scheduler
limits from ``/v1/models`` (``max_model_len``) and the command line. The profile records the fit's
R^2 and each sample, measured and predicted, so a poor fit is visible.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import math
import random
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import numpy as np

from controller.bench.client import pooled_connector
from controller.bench.workload import RequestSpec
from controller.control.normalize import Normalizer
from controller.sim.profile import CostModel, EngineLimits, Profile, Variance
from controller.sim.quantiles import LoadTables, QuantileTable
from controller.sim.run import ControlSettings, Simulation
from policies.base import build_policy

COLUMNS = ("a_s", "b_s_per_prefill_token", "c_s_per_decode_seq", "d_s_per_kv_token", "http_s")
LOAD_EDGES = (1, 2, 4, 8, 16, 32, 64)
"""Lowest in-flight count of each ``[variance.frontend_loaded]`` table."""
LOAD_RAMP_S = 2.0
"""Requests sent in a load phase's first seconds are replayed but not recorded: the load is still
ramping up to its level, and the client opens the extra connections it needs then."""
LOAD_MIN_SAMPLES = 100
"""A load level with fewer measured delays joins its neighbour (its p99 needs about 100)."""


@dataclass(frozen=True)
class Sample:
    """One measured row: step features (totals over ``steps`` steps) and the seconds they took."""

    kind: str
    """"decode" (one step between two streamed tokens) or "prefill" (a time to first token)."""
    steps: int
    prefill_tokens: int
    decode_seqs: int
    kv_tokens_read: int
    seconds: float

    def row(self) -> list[float]:
        ttft = 1.0 if self.kind == "prefill" else 0.0
        return [float(self.steps), self.prefill_tokens, self.decode_seqs, self.kv_tokens_read, ttft]


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active set: fix the most negative at 0, refit)."""
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[free] = sol
            return coef
        free.pop(int(np.argmin(sol)))
    return coef


def fit(samples: Sequence[Sample]) -> tuple[CostModel, float, float]:
    """The cost model, the fitted HTTP overhead of a TTFT, and R^2 over the samples."""
    if len(samples) < len(COLUMNS):
        raise ValueError(f"{len(samples)} samples: need at least {len(COLUMNS)} to fit {len(COLUMNS)} terms")
    x = np.array([s.row() for s in samples])
    y = np.array([s.seconds for s in samples])
    # Rows are scaled to relative error: a 2 ms step and a 200 ms prefill weigh the same.
    w = 1.0 / np.maximum(y, 1e-6)
    coef = nnls(x * w[:, None], y * w)
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    a, b, c, d, front = (float(v) for v in coef)
    model = CostModel(a, b, c, d, frontend_s=front)
    return model, float(coef[4]), 1.0 - ss_res / ss_tot


# -- talking to the server -------------------------------------------------------------------------


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
        """Send one request; (time sent, arrival time of each streamed token chunk)."""
        prompt = [self.rng.randrange(10, self.vocab) for _ in range(prompt_tokens)]
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        t0 = time.perf_counter()
        times: list[float] = []
        async with self.session.post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.url}: HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if json.loads(line[5:]).get("choices"):
                    times.append(time.perf_counter())
        return t0, times


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
            cost = fit(samples)[0]
            for k, target in enumerate(plan.load_in_flight):
                specs = load_workload(cost, limits, target, plan.load_requests, server.rng, plan.load_phase_s)
                phases.append(await load_phase(server, specs))
                ok = len(phases[-1].ttft_s)
                log(f"load phase {k + 1}: {len(specs)} requests for ~{target} in flight, {ok} answered")
                await asyncio.sleep(1.0)
    return Measurements(samples, ratios if plan.frontend_probes else [], ttfts, plan.frontend_prompt, phases)


def load_workload(
    cost: CostModel,
    limits: EngineLimits,
    in_flight: int,
    requests: int,
    rng: random.Random,
    seconds: float = 0.0,
) -> list[RequestSpec]:
    """Poisson arrivals, at least ``requests`` of them and for at least ``seconds``, at the rate that
    keeps ``in_flight`` requests in flight by Little's law with the fitted model: rate = in_flight /
    (prefill + mean output * decode step)."""
    hi = max(17, min(1024, limits.max_model_len // 2))
    mean_prompt, mean_out = (hi - 16) / math.log(hi / 16), 68.0
    decode = cost.step_s(0, in_flight, int(in_flight * (mean_prompt + mean_out / 2)))
    latency = cost.frontend_s + cost.step_s(int(mean_prompt), 0, int(mean_prompt)) + mean_out * decode
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
    start = time.perf_counter() + 0.05

    async def one(spec: RequestSpec) -> tuple[RequestSpec, float, list[float]]:
        await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
        try:
            t0, times = await server.stream(spec.prompt_tokens, spec.output_tokens)
        except (aiohttp.ClientError, RuntimeError):
            return spec, time.perf_counter(), []
        return spec, t0, times

    results = await asyncio.gather(*(one(s) for s in specs))
    sent = tuple(replace(spec, arrival_s=t0 - start) for spec, t0, _ in results)
    ok = [(spec, t0, times) for spec, t0, times in results if times]
    return LoadPhase(
        sent,
        {spec.index: times[0] - t0 for spec, t0, times in ok},
        {spec.index: times[-1] - t0 for spec, t0, times in ok},
    )


def median_sample(repeats: Sequence[Sample]) -> Sample:
    """One row per measured point: the median of its repeats (a shared machine gives outliers)."""
    return replace(repeats[0], seconds=statistics.median(s.seconds for s in repeats))


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


def variance(cost: CostModel, m: Measurements, limits: EngineLimits | None = None) -> Variance:
    """The quantile tables of the measured spread (empty where nothing was measured; the tables
    under load need the server's ``limits`` for the twin's replay)."""
    p = m.frontend_prompt
    delays = [max(0.0, t - cost.step_s(p, 0, p)) for t in m.frontend_ttfts]
    loaded = None
    if m.load_phases and limits is not None:
        pairs = [pair for phase in m.load_phases for pair in loaded_delays(cost, limits, phase)]
        loaded = LoadTables.from_samples(pairs, LOAD_EDGES, LOAD_MIN_SAMPLES)
    return Variance(
        frontend=QuantileTable.from_samples(delays) if delays else None,
        step=QuantileTable.from_samples(m.step_ratios) if m.step_ratios else None,
        frontend_loaded=loaded,
    )


def in_flight_at_send(phase: LoadPhase) -> dict[int, int]:
    """For each answered request, how many others were in flight (sent, not ended) when it was sent:
    those sent before it less those ended by then (an end always follows its own send)."""
    ended = [s for s in phase.specs if s.index in phase.e2e_s]
    starts = sorted(s.arrival_s for s in ended)
    ends = sorted(s.arrival_s + phase.e2e_s[s.index] for s in ended)
    return {
        s.index: bisect.bisect_left(starts, s.arrival_s) - bisect.bisect_right(ends, s.arrival_s)
        for s in phase.specs
        if s.index in phase.ttft_s
    }


def loaded_delays(
    cost: CostModel, limits: EngineLimits, phase: LoadPhase, ramp_s: float = LOAD_RAMP_S
) -> list[tuple[int, float]]:
    """(requests in flight at its send, measured TTFT - the twin's TTFT) for each answered request
    sent after the first ``ramp_s`` seconds. The twin replays the whole phase as sent: mean model,
    no front end, no gate in the way."""
    profile = Profile("calibration", replace(cost, frontend_s=0.0), limits)
    policy = build_policy("static", {}, max_num_seqs=limits.max_num_seqs, initial_limit=4096)
    control = ControlSettings(admission_limit=4096, max_queue=len(phase.specs) + 1, drain_s=3600.0)
    sim = Simulation(profile, policy, Normalizer(limit_max=4096), control, use_variance=False)
    twin = {r.index: r.ttft_s for r in asyncio.run(sim.run(phase.specs)).records}
    n = in_flight_at_send(phase)
    sent = {s.index: s.arrival_s for s in phase.specs}
    return [
        (n[i], max(0.0, ttft - twin_ttft))
        for i, ttft in phase.ttft_s.items()
        if (twin_ttft := twin.get(i)) is not None and sent[i] >= ramp_s
    ]


def build_profile(
    name: str, url: str, limits: EngineLimits, m: Measurements, hardware: str, model: str
) -> Profile:
    samples = m.samples
    cost, http_s, r2 = fit(samples)
    rows = [
        {
            "kind": s.kind,
            "prefill_tokens": s.prefill_tokens,
            "decode_seqs": s.decode_seqs,
            "kv_tokens_read": s.kv_tokens_read,
            "measured_s": round(s.seconds, 6),
            "predicted_s": round(
                cost.step_s(s.prefill_tokens, s.decode_seqs, s.kv_tokens_read)
                + (s.steps - 1) * cost.a_s
                + (http_s if s.kind == "prefill" else 0.0),
                6,
            ),
        }
        for s in samples
    ]
    return Profile(
        name=name,
        cost=cost,
        engine=limits,
        description=f"fitted by `vllm-autopilot bench calibrate` against {url} on "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}",
        hardware=hardware,
        model=model,
        sources=(url,),
        fit={
            "samples": len(samples),
            "r2": round(r2, 4),
            "ttft_http_overhead_s": http_s,
            "rows": json.dumps(rows),
        },
        variance=variance(cost, m, limits),
    )
