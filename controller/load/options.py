"""The workload options of the bench commands and of ``simulate``, and turning them into a workload."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from controller.load import phases
from controller.load.prompts import Tokenizer, counter
from controller.load.sessions import SharedPrefix, shared_prefix
from controller.load.workload import (
    RequestSpec,
    WorkloadError,
    assign_priorities,
    clamp_lengths,
    load_sharegpt,
    parse_priority_mix,
    poisson,
    poisson_arrivals,
    sharegpt_lengths,
    sharegpt_pairs,
    stall,
    trace_load,
    with_lengths,
)

WORKLOADS = ("phases", "closed", "stall", "shared-prefix")
WORKLOAD_HELP = (
    "a named workload: phases (the phase-changing load of controller/load/phases.py); closed (--requests N "
    "at once, lengths --prompt-tokens/--output-tokens; with --concurrency: a closed loop); stall (--requests "
    "N decoding streams, then one --long-prompt-tokens prompt: the longest decode gap its prefill causes); "
    "shared-prefix (chat sessions at --rate requests/s for --duration s: --system-prompts shared system "
    "prompts, --turns turns that re-send their history; controller/load/sessions.py)"
)


def add_shared_prefix_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The shape of ``--workload shared-prefix`` (``controller/load/sessions.py``)."""
    d = SharedPrefix()
    p.add_argument(
        "--system-prompts",
        type=int,
        default=d.system_prompts,
        help=f"shared-prefix: distinct system prompts (default {d.system_prompts})",
    )
    p.add_argument(
        "--system-tokens",
        type=int,
        default=d.system_tokens,
        help=f"shared-prefix: tokens of a system prompt (default {d.system_tokens})",
    )
    p.add_argument(
        "--turns", type=int, default=d.turns, help=f"shared-prefix: turns of a session (default {d.turns})"
    )
    p.add_argument(
        "--user-tokens",
        type=int,
        default=d.user_tokens,
        help=f"shared-prefix: mean tokens of a user text (default {d.user_tokens})",
    )
    p.add_argument(
        "--think-s",
        type=float,
        default=d.think_s,
        help=f"shared-prefix: mean seconds between turns (default {d.think_s:g})",
    )


def shared_prefix_specs(args: argparse.Namespace) -> list[RequestSpec]:
    """``--workload shared-prefix`` at ``--rate`` for ``--duration``, its answers ``--output-tokens`` long."""
    if args.rate is None or args.duration is None:
        raise WorkloadError("--workload shared-prefix needs --rate R (requests/s) and --duration S")
    shape = SharedPrefix(
        system_prompts=args.system_prompts,
        system_tokens=args.system_tokens,
        turns=args.turns,
        user_tokens=args.user_tokens,
        output_tokens=args.output_tokens,
        think_s=args.think_s,
    )
    return shared_prefix(args.rate, args.duration, shape, seed=args.seed)


def trace_specs(args: argparse.Namespace) -> tuple[list[RequestSpec], str]:
    """``--trace`` from ``--start`` (with ``--alternate``/``--phase-s``/``--total-s``), scaled by
    ``--time-scale`` and ``--token-scale``: the requests and a line that describes them."""
    return trace_load(
        args.trace,
        start_s=args.start,
        duration_s=args.duration,
        time_scale=args.time_scale,
        token_scale=args.token_scale,
        alternates=args.alternate,
        phase_s=args.phase_s,
        total_s=args.total_s,
    )


def add_alternate_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--alternate``/``--phase-s``/``--total-s``: a load that changes phase between traces."""
    p.add_argument(
        "--alternate",
        action="append",
        default=[],
        metavar="TRACE:SCALE[:START]",
        help="another trace (replayed SCALE x faster, from START s of trace time) whose windows "
        "alternate with --trace's, --phase-s each, for --total-s; repeatable",
    )
    p.add_argument("--phase-s", type=float, default=600.0, help="phase length of --alternate (seconds)")
    p.add_argument("--total-s", type=float, default=2400.0, help="length of the --alternate load (seconds)")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (one of --rate, --trace, --sharegpt, --workload)")
    g.add_argument("--workload", choices=WORKLOADS, help=WORKLOAD_HELP)
    g.add_argument("--requests", type=int, default=128, help="requests of --workload closed (default 128)")
    g.add_argument(
        "--concurrency", type=int, help="at most N requests in flight (arrivals wait for a free slot)"
    )
    g.add_argument("--rate", type=float, help="Poisson arrivals per second (with --duration)")
    g.add_argument(
        "--duration",
        type=float,
        help="seconds: the run's length with --rate/--sharegpt; "
        "the trace window's length (in trace time) with --trace",
    )
    g.add_argument("--prompt-tokens", type=int, default=128, help="prompt length with --rate (default 128)")
    g.add_argument("--output-tokens", type=int, default=128, help="output length with --rate (default 128)")
    g.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=1000,
        help="the long prompt of --workload stall (default 1000)",
    )
    g.add_argument(
        "--trace", type=Path, help="Azure-format trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)"
    )
    g.add_argument(
        "--start", type=float, default=0.0, help="trace window start, seconds after its first request"
    )
    g.add_argument(
        "--time-scale", type=float, default=1.0, help="replay the trace K times faster (default 1)"
    )
    g.add_argument("--token-scale", type=float, default=1.0, help="multiply trace lengths by K (default 1)")
    add_alternate_args(g)
    add_shared_prefix_args(g)
    g.add_argument(
        "--sharegpt",
        action="store_true",
        help="prompt/output lengths of ShareGPT conversations (pip install 'vllm-autopilot[sharegpt]'), "
        "on Poisson arrivals at --rate for --duration",
    )
    g.add_argument("--sharegpt-samples", type=int, default=1000, help="conversations to take lengths from")
    g.add_argument(
        "--priority-mix", help="vLLM priorities and their shares, e.g. 0:0.3,1:0.7 (lower = urgent)"
    )
    g.add_argument("--max-requests", type=int, help="keep only the first N requests of the workload")
    g.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and priorities (default 0)")


def build_specs(args: argparse.Namespace, tokenizer: Tokenizer, max_model_len: int) -> list[RequestSpec]:
    """The workload the options describe, clamped to the model's context, with priorities when asked."""
    rate_alone = args.rate is not None and not args.sharegpt and args.workload != "shared-prefix"
    given = {
        "--rate": rate_alone,
        "--trace": args.trace is not None,
        "--sharegpt": args.sharegpt,
        "--workload": args.workload is not None,
    }
    chosen = [name for name, on in given.items() if on]
    if len(chosen) != 1:
        raise WorkloadError(
            "choose exactly one workload: --rate R --duration S, --trace PATH, --sharegpt or --workload NAME;"
            f" got {chosen}"
        )
    if args.workload == "phases":
        specs = phases.schedule(args.seed)
    elif args.workload == "closed":
        specs = [RequestSpec(i, 0.0, args.prompt_tokens, args.output_tokens) for i in range(args.requests)]
    elif args.workload == "stall":
        specs = stall(args.requests, args.prompt_tokens, args.output_tokens, args.long_prompt_tokens)
    elif args.workload == "shared-prefix":
        specs = shared_prefix_specs(args)
    elif args.trace is not None:
        specs, _ = trace_specs(args)
    else:
        if args.rate is None or args.duration is None:
            raise WorkloadError(f"{chosen[0]} needs --rate R and --duration S")
        if args.sharegpt:
            pairs = sharegpt_pairs(load_sharegpt())
            lengths = sharegpt_lengths(
                pairs,
                counter(tokenizer),
                samples=args.sharegpt_samples,
                max_len=max_model_len,
                seed=args.seed,
            )
            arrivals = poisson_arrivals(args.rate, args.duration, random.Random(args.seed))
            specs = with_lengths(arrivals, lengths, seed=args.seed)
        else:
            specs = poisson(
                args.rate,
                args.duration,
                prompt_tokens=args.prompt_tokens,
                output_tokens=args.output_tokens,
                seed=args.seed,
            )
    if args.max_requests is not None:
        specs = specs[: args.max_requests]
    if args.priority_mix:
        specs = assign_priorities(specs, parse_priority_mix(args.priority_mix), seed=args.seed)
    if not specs:
        raise WorkloadError("the workload holds no request: raise --rate or --duration")
    return clamp_lengths(specs, max_model_len)
