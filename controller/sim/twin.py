"""The twin's wiring, written once: a :class:`Simulation` from a profile and the daemon's own tables.

The twin's control core is the daemon's, built by ``control/build.ControlCore`` from the same tables
(``[control]``, ``[admission]``, ``[slo]``); every caller of the twin (``simulate``, ``simulate
--compare``, ``bench validate``, the calibration's replay, the tests) builds through
:func:`build_simulation` so the twin runs what the daemon would run with the same tables.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from controller.config.load import AdmissionConfig, ControlConfig, load_config
from controller.profiles.load import Profile
from controller.results.records import write_run
from controller.sim.run import ControlSettings, SimResult, Simulation
from policies.slo_targets import SloBound, SloTargets


def build_simulation(
    profile: Profile,
    control: ControlConfig | None = None,
    admission: AdmissionConfig | None = None,
    *,
    drain_s: float = ControlSettings.drain_s,
    seed: int = 0,
    jitter: float = 0.0,
    use_variance: bool = True,
    slo: SloTargets | None = None,
) -> Simulation:
    """The twin under ``control`` (default: ``[control]``'s defaults, the slo policy) and
    ``admission`` (default: its defaults with the limit at the engine's ``max_num_seqs``, as
    config.toml sets it: no gate limit below the engine's ceiling), steering to ``slo`` (``[slo]``)
    where the policy does."""
    control = control or ControlConfig()
    admission = admission or AdmissionConfig(limit=profile.engine.max_num_seqs)
    settings = ControlSettings(control=control, admission=admission, drain_s=drain_s, slo=slo)
    return Simulation(profile, settings, seed=seed, jitter=jitter, use_variance=use_variance)


def with_config(
    profile: Profile,
    config: Path | None,
    policy: str | None,
    params: dict[str, Any],
    slo: tuple[float, float] | None = None,
) -> tuple[Profile, ControlConfig, AdmissionConfig, SloTargets | None]:
    """The profile with a config file's ``[engine]`` limits on top, and its ``[control]``,
    ``[admission]`` and ``[slo]`` (defaults without a file). ``policy`` replaces the file's policy and
    drops its params; ``params`` are laid over what is left; ``slo`` (TTFT, TPOT: the goodput SLO of
    ``--slo-ttft`` / ``--slo-tpot``) is the ``[slo]`` steered to when the file has none. Raises
    ``ConfigError`` and ``ProfileError``."""
    control, admission = ControlConfig(), AdmissionConfig(limit=profile.engine.max_num_seqs)
    targets = None
    if config is not None:
        loaded = load_config(config)
        limits = profile.engine.replace(loaded.engine, f"{config} [engine]")
        profile = dataclasses.replace(profile, engine=limits)
        control, admission, targets = loaded.control, loaded.admission, loaded.slo
    merged = dict(control.params) if policy is None else {}
    merged.update(params)
    control = dataclasses.replace(control, policy=policy or control.policy, params=merged)
    if targets is None and slo is not None:
        targets = slo_for(admission, *slo)
    return profile, control, admission, targets


def slo_for(admission: AdmissionConfig, ttft_s: float, tpot_s: float) -> SloTargets:
    """One bound for every class of ``admission`` (what ``[slo]`` with no class override resolves to)."""
    bound = SloBound(ttft_s, tpot_s)
    return SloTargets(bound, tuple((c.name, bound) for c in admission.classes))


def write_result(out: Path, result: SimResult, summary: dict[str, Any]) -> None:
    """What ``bench run`` writes (records, time series, summary), plus every knob change."""
    write_run(out, result.records, result.series, summary)
    with (out / "decisions.jsonl").open("w") as fh:
        for change in result.changes:
            fh.write(json.dumps(dataclasses.asdict(change)) + "\n")
