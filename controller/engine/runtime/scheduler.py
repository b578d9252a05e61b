"""Runtime batch cap and token budget inside the EngineCore process, and its per-step figures.

vLLM admits a waiting request into RUNNING while ``len(running) < scheduler.max_num_active_reqs``
(``max_num_active_seqs``) and issues at most ``scheduler.max_num_scheduled_tokens`` tokens per step
(vllm/v1/core/sched/scheduler.py). Nothing in vLLM changes either number at runtime, so this module,
which vLLM imports inside the EngineCore process through ``scheduler_cls``, does three things:

* the scheduler subclasses below expose ``set_batch_cap`` (clamped to ``control.knobs.cap_bounds``,
  [1, max_num_seqs]) and ``set_token_budget`` (clamped to ``control.knobs.token_budget_bounds``);
* they measure each step's figures (``stepmeter.StepMeter``: prefill tokens, decoding sequences, KV
  tokens, step time) into a bounded ring;
* it adds the utility methods ``autopilot_set_batch_cap``, ``autopilot_set_token_budget`` and
  ``autopilot_drain_steps`` to ``EngineCore``, which ``engine_core.call_utility_async`` runs there
  between two engine steps (never inside ``schedule()``, so a budget never changes mid-step);
* it has the EngineCore write why it died (a CUDA out-of-memory error or not) for the daemon before
  it sends vLLM's bare death message (``death.py``).

Lowering the cap never preempts: requests already running finish; only new admissions wait. Lowering
the budget never preempts either: a running prefill gets smaller chunks. The budget bounds a step that
carries a decode, whose stream it would stall; a step in which no running request decodes (prefill
alone) takes up to ``max_num_batched_tokens``, so a small budget costs a prompt no extra steps when
nothing waits for it (``controller/sim/engine.py`` plans steps the same way). What else reads
``max_num_scheduled_tokens`` in vLLM 0.32, and why a lower value keeps its invariants:

* ``schedule()`` starts ``token_budget`` from it and asserts the step's total stays within it (the
  utility runs between steps, so both read the same value);
* the input buffers, the encoder budget (``max_num_encoder_input_tokens``) and spec decode's slots
  (``input_budget - draft_slots``) come from ``max_num_batched_tokens``, which does not move;
* Mamba's block-aligned prefill split reads it as ``max_prefill_tokens``: a chunk narrower than a
  block then advances sub-block, a case vLLM handles ("A block too wide for one chunk");
* a spec-decode request whose padded decode does not fit the budget is left for the next step
  (vLLM prefers that to an unpadded one), hence the floor of 1 + draft tokens.

A budget below the running batch delays the decodes past the first ``budget`` running requests (vLLM
serves RUNNING in order): a policy keeps the budget at or above the batch it decodes.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore, EngineCoreProc

from controller.control.knobs import cap_bounds, token_budget_bounds
from controller.engine.runtime.death import write_note
from controller.engine.runtime.stepmeter import StepMeter, StepTuple

UTILITY_SET = "autopilot_set_batch_cap"
UTILITY_BUDGET = "autopilot_set_token_budget"
UTILITY_DRAIN = "autopilot_drain_steps"


class _LiveKnobsMixin:
    max_num_running_reqs: int
    max_num_active_reqs: int
    max_num_scheduled_tokens: int
    max_model_len: int
    num_spec_tokens: int
    scheduler_config: Any
    requests: dict[str, Any]
    running: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_meter = StepMeter()

    def set_batch_cap(self, cap: int) -> int:
        """Clamp ``cap`` to [1, max_num_seqs], apply it, and return the value in force."""
        self.max_num_active_reqs = cap_bounds(self.max_num_running_reqs).clamp(cap)
        return self.max_num_active_reqs

    def set_token_budget(self, budget: int) -> int:
        """Clamp ``budget`` to [floor, max_num_batched_tokens] (module docstring), apply it from the
        next step on, and return the value in force."""
        cfg = self.scheduler_config
        bounds = token_budget_bounds(
            int(cfg.max_num_batched_tokens),
            bool(cfg.enable_chunked_prefill),
            int(self.max_model_len),
            int(self.num_spec_tokens),
        )
        self.max_num_scheduled_tokens = bounds.clamp(budget)
        return self.max_num_scheduled_tokens

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        t_start = self.step_meter.clock()
        budget = self.max_num_scheduled_tokens
        if not any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running):
            # No running request decodes: a step of prefill alone stalls no stream, so it may take
            # the whole max_num_batched_tokens (vLLM reads the budget only inside schedule()).
            self.max_num_scheduled_tokens = max(budget, int(self.scheduler_config.max_num_batched_tokens))
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.max_num_scheduled_tokens = budget
        self.step_meter.scheduled(output, self.requests, t_start)
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        self.step_meter.finished(scheduler_output)
        return outputs


class CappedScheduler(_LiveKnobsMixin, Scheduler):
    """vLLM's synchronous scheduler with a runtime batch cap, token budget and step figures."""


class CappedAsyncScheduler(_LiveKnobsMixin, AsyncScheduler):
    """vLLM's async scheduler with a runtime batch cap, token budget and step figures."""


def _set_batch_cap(self: Any, cap: int) -> int:
    return int(self.scheduler.set_batch_cap(cap))


def _set_token_budget(self: Any, budget: int) -> int:
    return int(self.scheduler.set_token_budget(budget))


def _drain_steps(self: Any) -> list[StepTuple]:
    meter: StepMeter = self.scheduler.step_meter
    return meter.drain()


# EngineCore looks utility methods up by name with getattr (EngineCore._handle_client_request).
setattr(EngineCore, UTILITY_SET, _set_batch_cap)
setattr(EngineCore, UTILITY_BUDGET, _set_token_budget)
setattr(EngineCore, UTILITY_DRAIN, _drain_steps)

_send_engine_dead = getattr(
    EngineCoreProc._send_engine_dead, "_autopilot_original", EngineCoreProc._send_engine_dead
)


def _note_then_send_engine_dead(self: Any) -> None:
    # run_engine_core calls it inside its ``except`` block: the fatal error is the one being handled
    write_note(sys.exc_info()[1])
    _send_engine_dead(self)


_note_then_send_engine_dead._autopilot_original = _send_engine_dead  # type: ignore[attr-defined]
EngineCoreProc._send_engine_dead = _note_then_send_engine_dead  # type: ignore[method-assign]


def scheduler_path(async_scheduling: bool) -> str:
    """The ``scheduler_cls`` qualname that matches vLLM's own choice of scheduler."""
    cls = CappedAsyncScheduler if async_scheduling else CappedScheduler
    return f"{__name__}.{cls.__name__}"
