"""The twin's vLLM: ``SimLLM`` stands in for vLLM's ``AsyncLLM`` over the twin's ``SimEngine``, and
``SimHost`` for the daemon's engine host around it, so that each request of a simulation passes our
own engine client (``engine/frontend/client.GovernedEngineClient``) as it does in the daemon: its
admission, its slot and its part of the outcome ledger run unchanged, and the twin has none of its own.

What the virtual vLLM plays, and nothing more:

- the renderer's length check (``render``): a prompt whose prompt + max_tokens exceed
  ``max_model_len`` is answered 400, after the preflight and before ``generate``, as vLLM's handler
  renders the prompt between the two;
- ``check_admission``: vLLM's own queue limits, of which the twin configures none (a no-op);
- ``generate``: the request, one ``SimRequest`` per sequence of its ``n``, into the engine when it is
  first read, and one output when its last sequence ends, as vLLM answers a request that does not
  stream (``RequestOutputKind.FINAL_ONLY``): ``finished``, and ``metrics`` with vLLM's
  ``RequestStateStats`` timestamps on the virtual clock, so that the client's
  ``first_token_latency`` and ``engine_queue_s`` read there what they read in the daemon;
- the output handler after each step (``step_ended``): each finished request's output to its
  ``generate``, then the stat logger's part: the step to the step feed, and each finished sequence's
  figures (vLLM's ``FinishedRequestStats``) to the outcome ledger through the daemon's own
  ``engine/runtime/stats.report_finished``, before the client reads the output, as vLLM records them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, TypedDict

from controller.control.outcomes import OutcomeLedger
from controller.control.steps import EngineStep, StepFeed
from controller.engine.runtime.stats import report_finished
from controller.load.workload import RequestSpec
from controller.sim.engine import SimEngine, SimRequest


class SimPrompt(TypedDict):
    """A prompt as the renderer hands it to ``generate()``: vLLM's token prompt (the client reads its
    length, vLLM's ``extract_prompt_len``), whose content the twin names instead of spelling it: the
    workload's request (its own tokens) and the shared segments the prefix cache hashes."""

    prompt_token_ids: list[int]
    index: int
    segments: tuple[tuple[int, int], ...]
    arrival_time: float
    """When it was rendered (virtual seconds): vLLM 0.32's renderer stamps the input "before
    rendering", so vLLM's ``arrival_time`` and ``first_token_latency`` count the gate's queue too."""


@dataclass(frozen=True)
class SimParams:
    """The sampling parameters vLLM's handler passes (``SamplingParams``: what the client and the
    virtual vLLM read of them)."""

    max_tokens: int
    n: int = 1


@dataclass(frozen=True)
class SimStats:
    """vLLM's ``RequestStateStats`` of a finished request, in virtual seconds: its prompt was rendered
    at ``arrival_time`` (before the gate's queue) and the engine queued it (``queued_ts``) when it was
    added."""

    arrival_time: float
    queued_ts: float
    scheduled_ts: float
    """Its first scheduling (a preemption does not move it)."""
    first_token_ts: float
    last_token_ts: float
    first_token_latency: float
    """From ``arrival_time`` to the first token."""
    num_generation_tokens: int


@dataclass(frozen=True)
class SimOutput:
    """vLLM's ``RequestOutput`` of a streaming request: at its first token, and at its end."""

    request_id: str
    metrics: SimStats
    finished: bool = True
    num_cached_tokens: int | None = None
    """Of its prompt, the tokens the prefix cache served (its first sequence's, as vLLM reports it)."""


@dataclass(frozen=True)
class Finished:
    """One finished sequence as vLLM's stat logger gets it (``FinishedRequestStats``: the fields
    ``report_finished`` reads, computed as vLLM's ``IterationStats.update_from_finished_request``)."""

    request_id: str
    e2e_latency: float
    decode_time: float
    num_generation_tokens: int
    mean_time_per_output_token: float
    finish_reason: str = "length"
    """vLLM's ``FinishReason.LENGTH``: a twin's request ends at its ``max_tokens``, no other way."""

    @classmethod
    def of(cls, request_id: str, req: SimRequest) -> Finished:
        assert req.first_token_t is not None and req.last_token_t is not None and req.finish_t is not None
        decode = req.last_token_t - req.first_token_t
        tpot = decode / (req.output_tokens - 1) if req.output_tokens > 1 else 0.0
        return cls(request_id, req.finish_t - req.arrival_t, decode, req.output_tokens, tpot)


class PromptTooLong(ValueError):
    """vLLM's 400 for a prompt and ``max_tokens`` that do not fit ``max_model_len``."""

    status = 400


class SimLLM:
    """vLLM's ``AsyncLLM`` as the governed client reaches it, over ``engine`` (module docstring).
    ``steps``: the step feed the stat logger publishes to; ``outcomes``: the ledger it reports each
    finished request to."""

    def __init__(self, engine: SimEngine, steps: StepFeed, outcomes: OutcomeLedger) -> None:
        self.engine = engine
        self.steps = steps
        self.outcomes = outcomes
        self.model_config = _ModelConfig()
        self._ids: dict[SimRequest, str] = {}
        """The request id of each sequence in the engine."""

    def render(self, spec: RequestSpec) -> SimPrompt:
        """``spec``'s prompt as vLLM renders it; ``PromptTooLong`` where it does not fit."""
        asked = spec.prompt_tokens + spec.output_tokens
        if asked > self.engine.limits.max_model_len:
            raise PromptTooLong(f"prompt + max_tokens = {asked} > max_model_len")
        return SimPrompt(
            prompt_token_ids=[0] * spec.prompt_tokens,
            index=spec.index,
            segments=spec.segments,
            arrival_time=self.steps.now(),
        )

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM's own queue limits: none in the twin."""

    async def generate(
        self,
        prompt: SimPrompt,
        sampling_params: SimParams,
        request_id: str,
        *,
        priority: int = 0,
        **_kwargs: Any,
    ) -> AsyncGenerator[SimOutput, None]:
        """The request's ``n`` sequences into the engine now (the virtual clock's time), an output
        at its first token and one when the last sequence ends: a streaming client's request, as
        ``vllm bench serve`` sends them, whose first token the engine client tells the gate and
        the outcome ledger when it comes (with one output at the end, the TTFT check learned each
        request's residual only once its answer was done: 3-6 s late on the CPU profile)."""
        loop, now = asyncio.get_running_loop(), self.steps.now()
        seqs, ends = [], []
        first: asyncio.Future[None] = loop.create_future()

        def first_token(_req: SimRequest) -> None:
            if not first.done():
                first.set_result(None)

        for _ in range(max(1, sampling_params.n)):
            req = SimRequest(
                prompt["index"],  # its sequences share its prompt, and so its cached blocks
                len(prompt["prompt_token_ids"]),
                sampling_params.max_tokens,
                priority,
                now,
                segments=prompt["segments"],
            )
            end: asyncio.Future[None] = loop.create_future()
            req.on_finish = lambda _req, end=end: end.set_result(None)
            req.on_first_token = first_token
            self._ids[req] = request_id
            self.engine.add(req)
            seqs.append(req)
            ends.append(end)
        await first
        if not all(end.done() for end in ends):  # a one-token answer: its first output is its last
            yield SimOutput(request_id, _stats(prompt["arrival_time"], now, seqs), False, _cached(seqs))
        for end in ends:  # each awaited in turn: a gather would add an event-loop round
            await end
        yield SimOutput(request_id, _stats(prompt["arrival_time"], now, seqs), True, _cached(seqs))

    def step_ended(self, step: EngineStep, done: list[SimRequest]) -> None:
        """vLLM's output handler after a step: the finished sequences' outputs to their requests,
        then the stat logger: the step to the feed, each finished sequence to the outcome ledger."""
        for req in done:
            assert req.on_finish is not None
            req.on_finish(req)
        self.steps.publish([step])
        report_finished(self.outcomes, [Finished.of(self._ids.pop(req), req) for req in done])


def _cached(seqs: list[SimRequest]) -> int | None:
    """vLLM's ``RequestOutput.num_cached_tokens``: its first sequence's hit (None before it ran)."""
    hit = seqs[0].num_cached_tokens
    return hit if hit >= 0 else None


def _stats(rendered: float, added: float, seqs: list[SimRequest]) -> SimStats:
    """A request's ``RequestStateStats`` from its sequences, rendered at ``rendered`` and all added
    at ``added``."""
    first = min(r.first_token_t for r in seqs if r.first_token_t is not None)
    return SimStats(
        arrival_time=rendered,
        queued_ts=added,
        scheduled_ts=min(r.scheduled_t for r in seqs if r.scheduled_t is not None),
        first_token_ts=first,
        last_token_ts=max(r.last_token_t for r in seqs if r.last_token_t is not None),
        first_token_latency=first - rendered,
        num_generation_tokens=sum(r.output_tokens for r in seqs),
    )


@dataclass(frozen=True)
class _ModelConfig:
    """What the client's ``extract_prompt_len`` reads of vLLM's ``ModelConfig``."""

    is_encoder_decoder: bool = False


class SimHost:
    """The engine host around the virtual vLLM: as the control core reaches it
    (``control/build.CoreEngine``: the knobs in force, the batch cap and the token budget moved, each
    call returning at once as nothing crosses a process) and as the engine client does
    (``engine/frontend/client.ClientHost``: the engine, the attempts in flight, the ledger)."""

    def __init__(self, llm: SimLLM) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.outcomes = llm.outcomes
        self.in_flight: dict[int, tuple[str, Any]] = {}
        self.aborted: dict[int, str] = {}
        """Never filled: the twin's engine is never restarted."""

    @property
    def batch_cap(self) -> int:
        return self.engine.batch_cap

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs

    @property
    def token_budget(self) -> int:
        return self.engine.token_budget

    @property
    def max_num_batched_tokens(self) -> int:
        return self.engine.max_num_batched_tokens

    @property
    def token_budget_min(self) -> int:
        return self.engine.token_budget_min

    async def set_batch_cap(self, cap: int) -> int:
        return self.engine.set_batch_cap(cap)

    async def set_token_budget(self, budget: int) -> int:
        return self.engine.set_token_budget(budget)

    async def drain_steps(self) -> list[EngineStep]:
        """None wait to be pulled: the virtual vLLM publishes each step to the feed as it ends."""
        return []
