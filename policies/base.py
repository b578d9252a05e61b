"""What a policy sees, what it says, and how policies are found by name.

A policy is pure (STYLE.md practice 1): ``decide(observation, now_mono) -> Decision``. No I/O, no clock
reads, no engine handle. Clamping to the engine's bounds, tolerance, rate limits and "apply only on
change" belong to the loop's normalize stage, which tells the policy what it applied
(``Policy.applied``). Built-ins are found by name through ``BUILT_INS``, outside plug-ins as
``"module:Class"`` (STYLE.md practice 8).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from policies.cost import CostEstimate
from policies.slo_targets import SloTargets


@dataclass(frozen=True)
class Observation:
    """One tick's view of the system, built by the samplers, only read: by the policies, the normalize
    stage, the memory guard and the diagnosis. A field none of them reads does not belong here."""

    now_mono: float
    """Monotonic time of the observation (seconds)."""
    admission_limit: int
    """Admission limit in force."""
    batch_cap: int
    """Batch cap in force inside the engine."""
    max_num_seqs: int
    """Hard ceiling of the batch cap (the engine's max_num_seqs)."""
    in_flight: int
    """Requests holding a gate slot."""
    queued: int
    """Requests waiting in the gate."""
    running: int
    """Requests RUNNING in the engine at its last step."""
    kv_usage: float
    """KV-cache usage at the last step, 0..1."""
    kv_usage_mean: float
    """Mean KV-cache usage over the window."""
    kv_usage_max: float
    """Max KV-cache usage over the window."""
    preemptions_per_s: float
    """Preemptions per second over the window."""
    generated_tokens_per_s: float
    """Generated tokens per second over the window."""
    ttft_p99_s: float | None
    """p99 time to first token over the window; None without samples."""
    itl_p99_s: float | None
    """p99 inter-token latency over the window; None without samples."""
    stats_age_s: float | None
    """Seconds since the engine last reported a step; None before the first step."""
    gpu_memory_total_bytes: int | None = None
    """NVML: memory of the engine's GPUs (sum); None without a GPU."""
    gpu_memory_free_bytes: int | None = None
    """NVML: free memory on the engine's GPUs (sum); None without a GPU."""
    gpu_utilization: float | None = None
    """NVML: mean GPU utilisation, 0..1; None without a GPU."""
    host_memory_available_bytes: int | None = None
    """psutil: host memory available."""
    daemon_cpu_percent: float | None = None
    """psutil: CPU use of the daemon's own process (front end), percent of one core."""
    window_s: float = 10.0
    """Length of the window the rates and percentiles cover: an event stays visible this long."""
    token_budget: int = 2048
    """Token budget in force: the most tokens the engine's scheduler issues in one step (vLLM's
    ``max_num_scheduled_tokens``)."""
    max_num_batched_tokens: int = 2048
    """Hard ceiling of the token budget (the engine's max_num_batched_tokens, which sizes its buffers)."""
    token_budget_min: int = 1
    """Lowest token budget the engine takes (``policies/knobs.token_budget_bounds``: 16
    and one decode's draft tokens, or max_model_len when chunked prefill is off)."""
    served_total: int = 0
    """Requests served to the end since the start (``control/outcomes.OutcomeLedger``), counted once
    each when vLLM reports them finished; an engine error is not counted."""
    missed_total: int = 0
    """Of ``served_total``, those that missed their class's ``[slo]`` TTFT or TPOT bound (0 without
    ``[slo]``)."""
    queued_missed_total: int = 0
    """Of ``missed_total``, TTFT misses whose time went mostly to the gate's queue, not the engine."""
    refused_total: int = 0
    """Requests refused with a 429 since the start (the same ledger): each one a request lost."""
    answer_tokens: float | None = None
    """Output tokens of a short answer among those served lately (their 10th percentile,
    ``control/outcomes.OutcomeLedger.answer_tokens``): what one prefill chunk's step is shared over in
    vLLM's TPOT, a request's mean time per output token. None before enough were served."""
    asked_prefill_per_decode: float | None = None
    """Prompt tokens per output token the requests started lately asked for (``max_tokens``): the
    load's prefill mix before the engine's steps measure it, every prompt token counted (an upper
    bound: the prefix cache's hits are not known here). None before any request said both."""
    tpot_shares: tuple[tuple[int, float], ...] = ()
    """(``served_total`` when it was served, its TPOT over its class's ``[slo]`` TPOT bound) of the
    last requests served with a TPOT (``control/outcomes.OutcomeLedger.tpot_shares``): how near the
    bound their pace ran. Empty without ``[slo]``."""
    cost: CostEstimate | None = None
    """The online step-cost model's fit (``controller/control/stepcost.py``); None where none runs.
    A policy steering by it holds its knobs while ``cost.ready`` is False and says ``cost.reason``."""

    @property
    def idle(self) -> bool:
        """Nothing in flight or queued: old engine stats mean idle, not stalled."""
        return self.in_flight == 0 and self.queued == 0


@dataclass(frozen=True)
class Decision:
    """What a policy wants. ``None`` for a knob means "leave it as it is"."""

    admission_limit: int | None
    batch_cap: int | None
    reason: str
    """A short stable string: logged, exported as a metric label, shown in /state."""
    token_budget: int | None = None
    """The engine's per-step token budget; None (every policy that does not steer it) holds it."""


class Policy(ABC):
    """Base class of all policies. Subclasses document their formula, parameters and states."""

    name: ClassVar[str]
    param_names: ClassVar[tuple[str, ...]] = ()
    """The attributes ``params()`` reports (each one a constructor parameter of the same name)."""
    takes_slo: ClassVar[bool] = False
    """True: the constructor takes ``slo`` (``policies/slo_targets.SloTargets`` or None), which the builder
    passes from ``[slo]`` (a policy that steers to the SLO)."""

    normalize_defaults: ClassVar[Mapping[str, float]] = {}
    """The normalize stage's anti-flap settings this policy's asks need where ``[control]`` sets none
    (``tolerance``, ``reverse_after_s``; ``controller/control/normalize.py``): a policy whose asks
    jitter from tick to tick names a band here instead of keeping one of its own."""

    @abstractmethod
    def decide(self, obs: Observation, now_mono: float) -> Decision: ...

    def params(self) -> dict[str, Any]:
        """The effective parameters, for /state."""
        return {name: getattr(self, name) for name in self.param_names}

    def applied(self, admission_limit: int, batch_cap: int, now_mono: float) -> None:
        """The knobs in force after this tick's normalize and apply stages; the loop calls it every
        tick, holds included. The normalize stage may clamp, rate-limit or drop an ask: a policy whose
        next step depends on how much of its ask took effect learns it here instead of inferring it
        from the next observation. Most policies need only what is in force, which the next
        Observation carries, so the default does nothing. The token budget in force is not an
        argument: the next Observation carries it (``token_budget``)."""
        return None

    def terms(self) -> dict[str, float]:
        """Internal terms (error, integral, baseline, ...) exported as gauges."""
        return {}

    def learned(self) -> list[dict[str, Any]]:
        """What the policy learnt from served requests lately, newest last, each with its reason
        (the ``slo`` policy's margin looks), for /state and the log: a lesson that moves no knob
        appears nowhere else. Empty for a policy that learns nothing."""
        return []

    knee_share: float | None = None
    """The policy's throughput knee, where it steers to one (the ``slo`` policy without ``[slo]``):
    the capacity meter (``controller/control/capacity.py``) sizes the batch at it; None: none."""

    @property
    def mean_step_share(self) -> float:
        """Of the TPOT bound, what the policy lets a mean step take now (the capacity meter reads
        it): the bound itself unless the policy plans to less (the ``slo`` policy's mean margin)."""
        return 1.0


class PolicyError(ValueError):
    """A policy name or parameter is invalid; the message names it and the fix."""


class UnknownParameter(PolicyError):
    """``[control.params]`` names a parameter the policy does not take (``key``)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


BUILT_INS: dict[str, str] = {
    "hysteresis": "policies.hysteresis:HysteresisPolicy",
    "pid": "policies.pid:PidPolicy",
    "slo": "policies.slo_policy:SloPolicy",
    "static": "policies.static:StaticPolicy",
}
"""The built-in policies by name, as import strings: a policy module imports this one, so this one
imports a policy only when it is asked for (no import circle)."""


class _Registry(Mapping[str, type[Policy]]):
    """The built-ins by name; a class is imported the first time it is looked up."""

    def __getitem__(self, name: str) -> type[Policy]:
        return _load(name, BUILT_INS[name])

    def __iter__(self) -> Iterator[str]:
        return iter(BUILT_INS)

    def __len__(self) -> int:
        return len(BUILT_INS)


REGISTRY: Mapping[str, type[Policy]] = _Registry()


def resolve(name: str) -> type[Policy]:
    """A registered name, or ``"module:Class"`` for an outside plug-in."""
    if ":" in name:
        return _load(name, name)
    if name not in REGISTRY:
        raise PolicyError(
            f"unknown policy '{name}': use one of {', '.join(sorted(REGISTRY))} or 'module:Class'"
        )
    return REGISTRY[name]


def _load(name: str, target: str) -> type[Policy]:
    """The class ``target`` ("module:Class") names; errors quote ``name``, as the config spells it."""
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise PolicyError(f"policy '{name}': cannot import it ({exc}); check the module path") from exc
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"policy '{name}' is not a subclass of policies.base.Policy")
    return cls


def build_policy(
    name: str,
    params: Mapping[str, Any],
    *,
    max_num_seqs: int,
    initial_limit: int,
    slo: SloTargets | None = None,
) -> Policy:
    """Instantiate a policy; every policy takes its params plus the engine's ceiling and the
    initial admission limit as keyword arguments, and one that ``takes_slo`` the ``[slo]`` targets."""
    cls = resolve(name)
    extra: dict[str, Any] = dict(params)
    if cls.takes_slo:
        if "slo" in extra:
            raise PolicyError(f"[control.params] for policy '{name}': 'slo' comes from the [slo] table")
        extra["slo"] = slo
    _check_known(name, cls, params)
    try:
        return cls(max_num_seqs=max_num_seqs, initial_limit=initial_limit, **extra)  # type: ignore[call-arg]
    except TypeError as exc:
        raise PolicyError(f"[control.params] for policy '{name}': {exc}") from exc


def _check_known(name: str, cls: type[Policy], params: Mapping[str, Any]) -> None:
    """Raise ``UnknownParameter`` for the first key of ``params`` that ``cls`` does not take (its
    keyword parameters less those the builder passes; a class taking ``**kwargs`` takes any)."""
    found = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in found):
        return
    known = [p.name for p in found if p.name not in ("max_num_seqs", "initial_limit", "slo")]
    for key in params:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"its parameters: {', '.join(sorted(known))}"
            raise UnknownParameter(
                f"[control.params] for policy '{name}': unknown parameter '{key}': {fix}", key
            )
