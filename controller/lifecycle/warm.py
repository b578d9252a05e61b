"""Where the step-cost model starts: a named profile, a fit this box made before, or a warm-up.

At startup, once the engine is built and before the daemon reports ready:

1. ``[control] cost_profile`` named: the profile seeds the model (the twin and tests pin one).
2. else a state file holds a warm-up fit under this engine's cost key (model, dtype, the engine
   arguments that change a step, the hardware, vLLM's version): it seeds the model, no warm-up runs.
3. else ``[control] warmup_s`` > 0: a warm-up (``engine/runtime/warmup.py``) runs synthetic requests
   through the engine within that budget, the model is fitted to the steps it measured, and the fit is
   stored for the next start.
4. else the model starts empty and learns from the first requests (its policy holds until it is ready).

The fit seeds the online model as a prior of ``PRIOR_SAMPLES`` steps, so served traffic takes over at
that rate; ``/state`` shows where it came from (``cost.seed``) and ``warm_start``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from controller.control.stepcost import CostPrior, StepCostModel
from controller.control.warmfit import PRIOR_SAMPLES, plan, seed_from_warm_up
from controller.engine.runtime import warmup
from controller.engine.runtime.host import EngineHost
from policies.cost import StepCoefficients

log = structlog.get_logger(__name__)

STATE_FILE_VERSION = 1


@dataclass
class WarmStart:
    """How the step-cost model started, for /state."""

    source: str
    """"profile", "state_file", "warm-up" or "none"."""
    detail: str
    coefficients: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    seconds: float = 0.0
    median_rel_error: float | None = None
    """Median |measured - fitted| / measured over the warm-up's own steps."""
    path: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_dir() -> Path:
    """systemd's ``StateDirectory=`` (``$STATE_DIRECTORY``), else ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    systemd = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd:
        return Path(systemd)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-autopilot"


def state_path(key: dict[str, Any], directory: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return directory / f"stepcost-{digest}.json"


def read_state(path: Path, key: dict[str, Any]) -> StepCoefficients | None:
    """The stored fit, when the file is this version's and its key is this engine's; else None."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != STATE_FILE_VERSION or data.get("key") != key:
            return None
        return StepCoefficients.from_terms(data["coefficients"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_state(path: Path, key: dict[str, Any], warm: WarmStart) -> None:
    """Store the fit; a directory we cannot write is logged, never fatal."""
    data = {"version": STATE_FILE_VERSION, "key": key, **warm.as_dict()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
    except OSError as exc:
        log.warning("warmup_state_not_saved", path=str(path), error=str(exc))


async def warm_start(
    host: EngineHost, model: StepCostModel, profile: str, budget_s: float, directory: Path | None = None
) -> WarmStart:
    """Seed ``model`` as the module docstring says, and say how."""
    if profile:
        return WarmStart("profile", f"[control] cost_profile = {profile!r}")
    key = warmup.cost_key(host.llm)
    path = state_path(key, directory or state_dir())
    stored = read_state(path, key)
    if stored is not None:
        model.reset(CostPrior(stored, name=f"state file {path}", prior_samples=PRIOR_SAMPLES))
        warm = WarmStart(
            "state_file", "a warm-up fit this engine made before", stored.coefficients(), path=str(path)
        )
        log.info("warm_start", **warm.as_dict())
        return warm
    if budget_s <= 0:
        return WarmStart("none", "[control] warmup_s = 0: the model learns from served requests")
    await host.drain_steps()  # whatever the engine did before is not the warm-up's
    cfg = host.llm.vllm_config
    phases = plan(
        host.max_num_seqs,
        int(cfg.scheduler_config.max_num_batched_tokens),
        int(cfg.model_config.max_model_len),
    )
    ran = await warmup.run(host.llm, phases, budget_s, warmup.vocab_size(host.llm))
    steps = await host.drain_steps()
    if len(steps) < 4:
        return WarmStart("none", f"warm-up measured {len(steps)} steps: too few to fit", seconds=ran.seconds)
    coefficients, error = seed_from_warm_up(model, steps, ran.seconds)
    skipped = f"; skipped {', '.join(ran.skipped)} (budget {budget_s:g} s)" if ran.skipped else ""
    warm = WarmStart(
        source="warm-up",
        detail=f"phases {', '.join(ran.phases)}{skipped}",
        coefficients=coefficients.coefficients(),
        steps=len(steps),
        seconds=round(ran.seconds, 2),
        median_rel_error=error,
        path=str(path),
    )
    write_state(path, key, warm)
    log.info("warm_start", **warm.as_dict())
    return warm
