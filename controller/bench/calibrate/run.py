"""``bench calibrate``: fit the twin's step-time cost model from a running vLLM server.

Method. The cost model is linear in four step features (``policies/cost.StepCoefficients``)::

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

Spread (the profile's ``[variance]``, ``controller/profiles/quantiles.py``). The fit gives mean costs;
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

import argparse
import asyncio
import bisect
import json
import sys
import time
from pathlib import Path
from typing import Any

from controller.bench.calibrate.fit import fit
from controller.bench.calibrate.measure import (
    CalibrationPlan,
    LoadPhase,
    Measurements,
    config_limits,
    engine_limits,
    measure,
    our_daemon,
)
from controller.config.load import AdmissionConfig
from controller.profiles.load import EngineLimits, Profile, ProfileError, Variance, dump_profile
from controller.profiles.quantiles import LoadTables, QuantileTable
from policies.cost import StepCoefficients

LOAD_EDGES = (1, 2, 4, 8, 16, 32, 64)
"""Lowest in-flight count of each ``[variance.frontend_loaded]`` table."""
LOAD_RAMP_S = 2.0
"""Requests sent in a load phase's first seconds are replayed but not recorded: the load is still
ramping up to its level, and the client opens the extra connections it needs then."""
LOAD_MIN_SAMPLES = 100
"""A load level with fewer measured delays joins its neighbour (its p99 needs about 100)."""


def variance(cost: StepCoefficients, m: Measurements, limits: EngineLimits | None = None) -> Variance:
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
    cost: StepCoefficients, limits: EngineLimits, phase: LoadPhase, ramp_s: float = LOAD_RAMP_S
) -> list[tuple[int, float]]:
    """(requests in flight at its send, measured TTFT - the twin's TTFT) for each answered request
    sent after the first ``ramp_s`` seconds. The twin replays the whole phase as sent: mean model,
    no front end, no gate in the way."""
    from controller.sim.twin import build_simulation  # here: the twin's engine client loads vLLM

    profile = Profile("calibration", cost, limits)
    admission = AdmissionConfig(limit=4096, max_queue=len(phase.specs) + 1)
    sim = build_simulation(profile, admission=admission, drain_s=3600.0, use_variance=False)
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
        frontend_s=http_s,
    )


def calibrate(
    url: str,
    metrics_url: str | None,
    out: Path,
    name: str,
    plan: CalibrationPlan,
    overrides: dict[str, Any],
    described: tuple[str, str] = ("", ""),
) -> Profile:
    """Measure the server at ``url``, fit, write the profile to ``out`` and return it.
    ``overrides``: engine limits the server does not report (None: ask the server);
    ``described``: the hardware and model strings the profile records."""
    limits, vocab = asyncio.run(engine_limits(url, metrics_url, overrides))
    measured = asyncio.run(measure(url, plan, limits, vocab, seed=0))
    profile = build_profile(name, url, limits, measured, *described)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_profile(profile))
    return profile


def describe_fit(profile: Profile, path: Path) -> list[str]:
    """What a calibration found, for the terminal."""
    c, v = profile.cost, profile.variance
    lines = [
        f"wrote {path}: a={c.a_s * 1e3:.3f} ms, b={c.b_s_per_prefill_token * 1e6:.3f} us/token, "
        f"c={c.c_s_per_decode_seq * 1e6:.3f} us/seq, d={c.d_s_per_kv_token * 1e9:.3f} ns/kv-token, "
        f"R^2={profile.fit['r2']} over {profile.fit['samples']} samples"
    ]
    if v.frontend:
        f = v.frontend
        lines.append(
            f"front end over {f.samples} probes: p50 {f.sample(0.5) * 1e3:.2f} ms, "
            f"p99 {f.sample(0.99) * 1e3:.2f} ms, max {f.values[-1] * 1e3:.2f} ms"
        )
    if v.step:
        lines.append(
            f"step / mean step over {v.step.samples} gaps: p1 {v.step.sample(0.01):.2f}, "
            f"p50 {v.step.sample(0.5):.2f}, p99 {v.step.sample(0.99):.2f}"
        )
    if v.frontend_loaded:
        for level, t in zip(v.frontend_loaded.levels, v.frontend_loaded.tables, strict=True):
            lines.append(
                f"front end with >= {level} in flight over {t.samples} requests: "
                f"p50 {t.sample(0.5) * 1e3:.2f} ms, p99 {t.sample(0.99) * 1e3:.2f} ms"
            )
    return lines


def add_parser(bench_sub: Any) -> None:
    plan = CalibrationPlan()
    p = bench_sub.add_parser(
        "calibrate",
        help="fit the twin's cost model from a vLLM server and write a profile",
        description="Drive prefill-heavy and decode-heavy loads against URL (or our daemon started with "
        "--config) and fit step_s = a + b*prefill_tokens + c*decode_seqs + d*kv_tokens_read by least "
        "squares (controller/bench/calibrate/run.py).",
    )
    p.add_argument("--url", default=None, help="base URL of a running OpenAI API, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="instead of --url: start our daemon with this config.toml (free ports, the bench's "
        "launcher), fit against it, stop it",
    )
    p.add_argument("--out", type=Path, required=True, help="profile file to write (.toml)")
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default URL/metrics)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the server's max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's token budget")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV capacity when /metrics lacks it")
    p.add_argument("--max-concurrency", type=int, default=64, help="largest decode batch to measure")
    p.add_argument("--repeats", type=int, default=5, help="measurements of each point (the median is fitted)")
    p.add_argument(
        "--prefill-prompts",
        type=prompt_list,
        default=plan.prefill_prompts,
        help="prompt lengths of the prefill points, comma-separated (default 32,...,1536); the "
        "fit is linear in prefill tokens, and on a CPU long prompts cost more a token "
        "(attention), so measure the lengths the traffic has",
    )
    p.add_argument(
        "--frontend-probes",
        type=int,
        default=200,
        help="light-load requests timing the front end's spread (0: no [variance])",
    )
    p.add_argument(
        "--load-in-flight",
        type=in_flight_list,
        default=plan.load_in_flight,
        help="in-flight targets of the open-loop phases that time the front end under load "
        "('' for none; default 2,6,12,24)",
    )
    p.add_argument(
        "--load-phase-s",
        type=float,
        default=plan.load_phase_s,
        help="seconds per load phase, at least (default 30)",
    )
    p.add_argument(
        "--load-requests",
        type=int,
        default=plan.load_requests,
        help="requests per load phase, at least (default 300)",
    )
    p.add_argument("--hardware", default="", help="recorded in the profile")
    p.add_argument("--model", default="", help="recorded in the profile")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Fit against ``--url``, or against our daemon started with ``--config``'s tables."""
    if (args.url is None) == (args.config is None):
        print(
            "bench calibrate: give --url URL (a running server) or --config PATH (start our daemon)",
            file=sys.stderr,
        )
        return 2
    overrides = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "scheduling_policy": args.scheduling_policy,
        "kv_cache_tokens": args.kv_cache_tokens,
    }
    plan = CalibrationPlan(
        concurrency=tuple(n for n in CalibrationPlan.concurrency if n <= args.max_concurrency),
        prefill_prompts=args.prefill_prompts,
        repeats=args.repeats,
        frontend_probes=args.frontend_probes,
        load_in_flight=args.load_in_flight,
        load_requests=args.load_requests,
        load_phase_s=args.load_phase_s,
    )
    name, described = args.name or args.out.stem, (args.hardware, args.model)
    try:
        if args.config is None:
            profile = calibrate(args.url, args.metrics_url, args.out, name, plan, overrides, described)
        else:
            overrides = config_limits(args.config, overrides)
            with our_daemon(args.config, args.out.parent / f"{args.out.stem}-logs") as server:
                url, metrics = server.base_url, server.metrics_url
                profile = calibrate(url, metrics, args.out, name, plan, overrides, described)
    except (OSError, ProfileError, RuntimeError) as exc:
        print(f"bench calibrate: {args.url or args.config}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(describe_fit(profile, args.out)))
    return 0


def prompt_list(text: str) -> tuple[int, ...]:
    """``--prefill-prompts``: comma-separated prompt lengths >= 1, at least two (the fit's slope)."""
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: write prompt lengths like 16,64,256") from exc
    if len(values) < 2 or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least two prompt lengths, each >= 1")
    return values


def in_flight_list(text: str) -> tuple[int, ...]:
    """``--load-in-flight``: comma-separated counts >= 1, or empty for none."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        msg = f"{text!r}: write in-flight counts like 2,6,12,24 (or '' for none)"
        raise argparse.ArgumentTypeError(msg) from exc
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: in-flight counts must be >= 1")
    return values
