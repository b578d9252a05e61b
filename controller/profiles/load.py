"""The profile format: a hardware + model's step cost, the engine's limits and the measured spread.

A profile is a TOML file. The shipped ones live in ``controller/profiles/`` (package data, so
``pip install`` carries them) and are found by name; any other path is read as it is. Layout::

    name = "h200-8b"
    description = "..."
    hardware = "1x NVIDIA H200 141GB"
    model = "meta-llama/Llama-3.1-8B-Instruct, bf16"
    sources = ["https://...", ...]          # where the coefficients come from

    [cost]                                   # policies/cost.StepCoefficients: a + b*P + c*D + d*K
    frontend_s = 0.0                         # optional: front-end time added to each request
    a_s = 0.0045
    b_s_per_prefill_token = 6.0e-5
    c_s_per_decode_seq = 2.0e-5
    d_s_per_kv_token = 2.0e-8

    [engine]                                 # the vLLM settings the coefficients were fitted under
    max_num_seqs = 256
    max_num_batched_tokens = 8192
    block_size = 16
    kv_cache_tokens = 460000                 # KV capacity in tokens (num_gpu_blocks * block_size)
    max_model_len = 131072
    scheduling_policy = "fcfs"               # or "priority"
    enable_chunked_prefill = true
    enable_prefix_caching = true             # optional, vLLM's default

    [fit]                                    # optional: how well the fit matched its samples
    samples = 40
    r2 = 0.99

    [variance.frontend]                      # optional: measured front-end delay (seconds)
    samples = 200
    quantiles = [0.004, ..., 0.031]          # p0, p1, ..., p100 (any n >= 2, evenly spaced)
    [variance.step]                          # optional: measured step-time multiplier
    samples = 5000
    quantiles = [0.62, ..., 2.9]
    [variance.frontend_loaded]               # optional: front-end delay by requests in flight
    levels = [1, 4, 8, 16]                   # table i: levels[i] .. levels[i+1]-1 in flight
    samples = [310, 420, 650, 380]
    quantiles = [[...], [...], [...], [...]] # one p0..p100 table per level

Without ``[variance]`` the twin is the mean model: every request's front end takes ``frontend_s``
and every step exactly ``step_s``. With it, the twin draws each request's front-end delay and each
step's multiplier from the tables (``controller/sim/run.py``, ``controller/profiles/quantiles.py``); with
``[variance.frontend_loaded]`` a request that finds other requests in flight draws its front-end
delay from the table of that load instead.

Engine keys may be overridden by a config file's ``[engine]`` table (``simulate --config``); the cost
coefficients may not, they belong to the hardware and the model.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from controller.profiles.quantiles import LoadTables, QuantileTable, parse_load_tables, parse_table
from policies.cost import TERMS, StepCoefficients

PROFILE_PACKAGE = "controller.profiles"
SCHEDULING_POLICIES = ("fcfs", "priority")


class ProfileError(ValueError):
    """A profile is missing or invalid; the message names the key and the fix."""


@dataclass(frozen=True)
class EngineLimits:
    """The vLLM scheduler settings the twin runs under (vLLM's own names)."""

    max_num_seqs: int = 256
    """Hard ceiling of RUNNING requests (and of the batch cap)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (vLLM's ``SchedulerConfig.max_num_batched_tokens``)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_tokens: int = 65536
    """KV-cache capacity in tokens; the twin has ``kv_cache_tokens // block_size`` blocks."""
    max_model_len: int = 2048
    """Longest prompt + output a request may have; longer ones are refused, as vLLM does."""
    scheduling_policy: str = "fcfs"
    """"fcfs" or "priority" (lower ``priority`` first)."""
    enable_chunked_prefill: bool = True
    """Split a long prompt over steps; without it a prompt must fit the token budget whole."""
    enable_prefix_caching: bool = True
    """vLLM's automatic prefix caching (its default: on): cached full blocks of a prompt are not
    prefilled again (``controller/sim/kvcache.py``)."""

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    def validate(self, where: str) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "kv_cache_tokens",
            "max_model_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"{where}: {name} = {value!r}: must be an integer >= 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ProfileError(
                f"{where}: scheduling_policy = {self.scheduling_policy!r}: use one of {SCHEDULING_POLICIES}"
            )
        for flag in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, flag), bool):
                raise ProfileError(f"{where}: {flag} = {getattr(self, flag)!r}: must be true or false")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ProfileError(
                f"{where}: kv_cache_tokens = {self.kv_cache_tokens} holds less than one request of "
                f"max_model_len = {self.max_model_len} tokens (vLLM refuses to start so); "
                "raise kv_cache_tokens or lower max_model_len"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ProfileError(
                f"{where}: without chunked prefill max_num_batched_tokens = {self.max_num_batched_tokens} "
                f"must be >= max_model_len = {self.max_model_len} (vLLM's own rule)"
            )

    def replace(self, overrides: dict[str, Any], where: str) -> EngineLimits:
        """These limits with a config's ``[engine]`` keys on top (unknown vLLM keys are ignored)."""
        known = {f.name for f in dataclasses.fields(self)}
        picked = {k: v for k, v in overrides.items() if k in known}
        new = dataclasses.replace(self, **picked)
        new.validate(where)
        return new


@dataclass(frozen=True)
class Variance:
    """Measured spread around the cost model (``bench calibrate`` fills it; both are optional)."""

    frontend: QuantileTable | None = None
    """Seconds a request spends in the front end before the engine sees it (its TTFT minus the
    predicted prefill step, one light-load request at a time). Replaces ``frontend_s`` when set."""
    step: QuantileTable | None = None
    """A step's duration over the mean step (single inter-token gaps of lockstep decodes over their
    stream's mean gap). The twin rescales it to mean 1, so the cost model stays the mean step."""
    frontend_loaded: LoadTables | None = None
    """Front-end delay of a request that finds ``n >= 1`` requests in flight, by ``n``: its TTFT
    minus the twin's own TTFT for it, measured under open-loop load. ``frontend`` stays the idle
    case (``n = 0``)."""

    def as_dict(self) -> dict[str, dict[str, Any]]:
        tables: tuple[tuple[str, QuantileTable | LoadTables | None], ...] = (
            ("frontend", self.frontend),
            ("step", self.step),
            ("frontend_loaded", self.frontend_loaded),
        )
        return {k: t.as_dict() for k, t in tables if t}


@dataclass(frozen=True)
class Profile:
    name: str
    cost: StepCoefficients
    """The ``[cost]`` table's step coefficients: the twin's step time, the online fit's seed."""
    engine: EngineLimits
    description: str = ""
    hardware: str = ""
    model: str = ""
    sources: tuple[str, ...] = ()
    fit: dict[str, Any] = field(default_factory=dict)
    variance: Variance = Variance()
    """Measured front-end and step-time distributions; empty for a derived profile."""
    frontend_s: float = 0.0
    """The ``[cost]`` table's ``frontend_s``, not a step cost: seconds a request spends in the server's
    front end (HTTP, parsing, the first chunk's way back) on top of the engine's time to first token.
    The twin delays each request's entry by it and counts it in TTFT, as a client does."""
    path: str = ""
    """Where the profile was read from."""


def available_profiles() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(
        p.name.removesuffix(".toml")
        for p in resources.files(PROFILE_PACKAGE).iterdir()
        if p.name.endswith(".toml")
    )


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``cpu-tiny``, ``cpu-smollm2``, ``h200-8b``) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text()
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror}; pass a path or a name") from exc
        return parse_profile(text, str(path))
    shipped = resources.files(PROFILE_PACKAGE) / f"{name_or_path}.toml"
    if not shipped.is_file():
        raise ProfileError(
            f"unknown profile '{name_or_path}': use one of {', '.join(available_profiles())} "
            "or the path of a .toml file (`vllm-autopilot bench calibrate` writes one)"
        )
    return parse_profile(shipped.read_text(), f"{PROFILE_PACKAGE}/{name_or_path}.toml")


def parse_profile(text: str, where: str) -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{where}: not valid TOML ({exc})") from exc
    cost_raw = data.get("cost")
    if not isinstance(cost_raw, dict):
        raise ProfileError(f"{where}: the [cost] table is missing (a_s, b_s_per_prefill_token, ...)")
    cost_fields = [*TERMS, "frontend_s"]
    coef: dict[str, float] = {}
    for key in cost_fields:
        value = cost_raw.get(key, 0.0 if key == "frontend_s" else None)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ProfileError(f"{where}: [cost] {key} = {value!r}: must be a number >= 0")
        coef[key] = float(value)
    unknown = set(cost_raw) - set(cost_fields)
    if unknown:
        raise ProfileError(f"{where}: unknown [cost] keys {sorted(unknown)}; known: {cost_fields}")
    engine_raw = data.get("engine", {})
    known = {f.name for f in dataclasses.fields(EngineLimits)}
    if not isinstance(engine_raw, dict) or set(engine_raw) - known:
        bad = sorted(set(engine_raw) - known) if isinstance(engine_raw, dict) else engine_raw
        raise ProfileError(f"{where}: unknown [engine] keys {bad}; known: {sorted(known)}")
    engine = EngineLimits(**engine_raw)
    engine.validate(where)
    sources = data.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise ProfileError(f"{where}: sources must be a list of strings (URLs)")
    fit = data.get("fit", {})
    variance = parse_variance(data.get("variance", {}), where)
    return Profile(
        name=str(data.get("name", Path(where).stem)),
        cost=StepCoefficients.from_terms(coef),
        engine=engine,
        description=str(data.get("description", "")),
        hardware=str(data.get("hardware", "")),
        model=str(data.get("model", "")),
        sources=tuple(sources),
        fit=dict(fit) if isinstance(fit, dict) else {},
        variance=variance,
        frontend_s=coef["frontend_s"],
        path=where,
    )


VARIANCE_TABLES = ("frontend", "step", "frontend_loaded")


def parse_variance(raw: Any, where: str) -> Variance:
    if not isinstance(raw, dict) or set(raw) - set(VARIANCE_TABLES):
        names = ", ".join(f"[variance.{k}]" for k in VARIANCE_TABLES)
        raise ProfileError(f"{where}: [variance] may hold only {names}")
    tables: dict[str, QuantileTable] = {}
    loaded = None
    try:
        for key in ("frontend", "step"):
            if key in raw:
                tables[key] = parse_table(raw[key], f"{where}: [variance.{key}]")
        if "frontend_loaded" in raw:
            loaded = parse_load_tables(raw["frontend_loaded"], f"{where}: [variance.frontend_loaded]")
    except ValueError as exc:
        raise ProfileError(str(exc)) from exc
    if "step" in tables and tables["step"].mean() <= 0:
        raise ProfileError(f"{where}: [variance.step] has mean 0; a step multiplier table needs values > 0")
    return Variance(tables.get("frontend"), tables.get("step"), loaded)


def dump_profile(profile: Profile) -> str:
    """The TOML text of ``profile`` (what ``bench calibrate`` writes)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list | tuple):
            return "[\n" + "".join(f"    {value(x)},\n" for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [f"{k} = {value(getattr(profile, k))}" for k in ("name", "description", "hardware", "model")]
    lines.append(f"sources = {value(list(profile.sources))}")
    for table, items in (
        ("cost", {**profile.cost.coefficients(), "frontend_s": profile.frontend_s}),
        ("engine", dataclasses.asdict(profile.engine)),
        ("fit", profile.fit),
    ):
        lines.append(f"\n[{table}]")
        lines.extend(f"{k} = {value(v)}" for k, v in items.items())
    for key, qt in profile.variance.as_dict().items():
        lines.append(f"\n[variance.{key}]")
        if key == "frontend_loaded":
            lines.append(f"levels = {qt['levels']}")
            lines.append(f"samples = {qt['samples']}")
            rows = ("    [" + ", ".join(repr(v) for v in row) + "],\n" for row in qt["quantiles"])
            lines.append("quantiles = [\n" + "".join(rows) + "]")
            continue
        lines.append(f"samples = {qt['samples']}")
        lines.append("quantiles = [" + ", ".join(repr(v) for v in qt["quantiles"]) + "]")
    return "\n".join(lines) + "\n"
