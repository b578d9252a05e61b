"""The shared-prefix workload: system prompts shared by many requests, and chats that re-send their history.

Chat traffic re-sends text the server has seen: every conversation opens with one of a few system
prompts, and each turn's prompt is the previous turn's prompt, the answer to it and the new user text.
With prefix caching (vLLM's default) the server computes only the part it has not cached, so this is
the load on which a server with caching and one without differ.

Sessions start as Poisson arrivals at ``rate / turns`` a second over ``duration_s``, so requests come
at about ``rate`` a second; each picks a system prompt at random, and its turns follow one another
``think_s`` apart on average (exponential gaps, open loop: a turn does not wait for the answer before).
User texts and answers are drawn between half and one and a half times ``user_tokens`` and
``output_tokens``. A request's prompt is described by segments (``RequestSpec.segments``): the system
prompt (segment ids ``0 .. system_prompts - 1``), then per earlier turn its user text and its answer,
then its own user text, each a segment of its own id. The answer in the history is the workload's text
of the answer's length, not what the server generated (the workload is data, fixed before the run), so
a server reuses a turn's prompt, not its generated answer; the twin (``controller/sim/kvcache.py``)
sees the same segments and caches the same way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from controller.load.workload import RequestSpec, WorkloadError, poisson_arrivals


@dataclass(frozen=True)
class SharedPrefix:
    """The shape of a shared-prefix load (``--workload shared-prefix``)."""

    system_prompts: int = 4
    """Distinct system prompts the sessions share."""
    system_tokens: int = 512
    """Tokens of each system prompt."""
    turns: int = 4
    """Turns of each session."""
    user_tokens: int = 64
    """Mean tokens of a user text."""
    output_tokens: int = 128
    """Mean tokens of an answer."""
    think_s: float = 5.0
    """Mean seconds between a session's turns."""

    def check(self) -> None:
        counts = (self.system_prompts, self.system_tokens, self.turns, self.user_tokens, self.output_tokens)
        if min(counts) < 1 or self.think_s < 0:
            raise WorkloadError(
                f"--workload shared-prefix: --system-prompts {self.system_prompts}, --system-tokens "
                f"{self.system_tokens}, --turns {self.turns}, --user-tokens {self.user_tokens} and "
                f"--output-tokens {self.output_tokens} must be >= 1, --think-s {self.think_s} >= 0"
            )


def shared_prefix(rate: float, duration_s: float, shape: SharedPrefix, seed: int = 0) -> list[RequestSpec]:
    """The requests of sessions started over ``duration_s`` at ``rate / turns`` a second, by arrival."""
    shape.check()
    rng = random.Random(seed)
    starts = poisson_arrivals(rate / shape.turns, duration_s, rng)
    next_id = shape.system_prompts
    turns: list[tuple[float, tuple[tuple[int, int], ...], int]] = []
    for start in starts:
        history: tuple[tuple[int, int], ...] = ((rng.randrange(shape.system_prompts), shape.system_tokens),)
        t = start
        for turn in range(shape.turns):
            if turn:
                t += rng.expovariate(1.0 / shape.think_s) if shape.think_s > 0 else 0.0
            user, answer = _around(rng, shape.user_tokens), _around(rng, shape.output_tokens)
            prompt = (*history, (next_id, user))
            turns.append((t, prompt, answer))
            history = (*prompt, (next_id + 1, answer))
            next_id += 2
    turns.sort(key=lambda item: item[0])
    return [
        RequestSpec(i, t, sum(n for _, n in segs), answer, segments=segs)
        for i, (t, segs, answer) in enumerate(turns)
    ]


def _around(rng: random.Random, mean: int) -> int:
    """A length drawn uniformly from [mean / 2, 3 mean / 2], at least 1."""
    return rng.randint(max(1, mean // 2), max(1, mean + mean // 2))


def within(segments: tuple[tuple[int, int], ...], tokens: int) -> tuple[tuple[int, int], ...]:
    """``segments`` cut to the first ``tokens`` tokens (a prompt clamped to the model's context)."""
    out: list[tuple[int, int]] = []
    left = tokens
    for seg, n in segments:
        if left <= 0:
            break
        out.append((seg, min(n, left)))
        left -= n
    return tuple(out)
