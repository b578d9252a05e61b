"""Runtime batch cap inside the EngineCore process.

vLLM admits a waiting request into RUNNING while ``len(running) < scheduler.max_num_active_reqs``
(``max_num_active_seqs``; vllm/v1/core/sched/scheduler.py). Nothing in vLLM changes that number at
runtime, so this module, which vLLM imports inside the EngineCore process through ``scheduler_cls``,
does two things:

* the scheduler subclasses below expose ``set_batch_cap`` (clamped to [1, max_num_seqs]);
* it adds the utility method ``autopilot_set_batch_cap`` to ``EngineCore``, which
  ``engine_core.call_utility_async`` runs there between two engine steps.

Lowering the cap never preempts: requests already running finish; only new admissions wait.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

UTILITY_SET = "autopilot_set_batch_cap"


class _BatchCapMixin:
    max_num_running_reqs: int
    max_num_active_reqs: int

    def set_batch_cap(self, cap: int) -> int:
        """Clamp ``cap`` to [1, max_num_seqs], apply it, and return the value in force."""
        self.max_num_active_reqs = max(1, min(int(cap), self.max_num_running_reqs))
        return self.max_num_active_reqs


class CappedScheduler(_BatchCapMixin, Scheduler):
    """vLLM's synchronous scheduler with a runtime batch cap."""


class CappedAsyncScheduler(_BatchCapMixin, AsyncScheduler):
    """vLLM's async scheduler with a runtime batch cap."""


def _set_batch_cap(self: Any, cap: int) -> int:
    return int(self.scheduler.set_batch_cap(cap))


# EngineCore looks utility methods up by name with getattr (EngineCore._handle_client_request).
setattr(EngineCore, UTILITY_SET, _set_batch_cap)


def scheduler_path(async_scheduling: bool) -> str:
    """The ``scheduler_cls`` qualname that matches vLLM's own choice of scheduler."""
    cls = CappedAsyncScheduler if async_scheduling else CappedScheduler
    return f"{__name__}.{cls.__name__}"
