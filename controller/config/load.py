"""config.toml -> frozen dataclasses, validated once (STYLE.md practice 7).

One dataclass per table. Every field documents itself (``doc``) and its bounds, read back as a ``Key``
(``fields.py``) that checks a value; errors name the key, the value and the fix. ``load_config``
collects every error before raising, so an operator fixes the file in one pass.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.admission.classes import (
    DEFAULT_CLASSES,
    PRIORITY_MAX,
    PRIORITY_MIN,
    PriorityBounds,
    PriorityClass,
)
from controller.config.checks import (
    cross_table_errors,
    kv_floor_errors,
    kv_floor_need,
    policy_errors,
    server_option_errors,
)
from controller.config.classes_table import parse_classes
from controller.config.fields import doc_field as _f
from controller.config.fields import field_key, non_finite_errors
from controller.config.fields import suggest as _suggest
from controller.config.secrets import redact, scrub
from controller.config.slo_table import SloTargets, cost_profile_errors, describe_slo, parse_slo
from policies.base import Policy, build_policy

DEFAULT_CONFIG = Path("config.toml")


class ConfigError(Exception):
    """The config file is invalid; ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


SMALL_HOST_CPUS = 8
"""Below this many usable CPUs the daemon's engine processes poll with a sleep by default."""


def default_engine_poll_sleep() -> float:
    """[server] engine_poll_sleep_s when the file does not set it (controller/engine/runtime/ipc.py): on a
    small host vLLM's two spinning processes take the cores the API server needs."""
    return 0.0002 if len(os.sched_getaffinity(0)) < SMALL_HOST_CPUS else 0.0


@dataclass(frozen=True)
class ServerConfig:
    """[server]: the data plane (vLLM's OpenAI-compatible app)."""

    host: str = _f("127.0.0.1", "Address the OpenAI-compatible API listens on.")
    port: int = _f(8000, "Port of the OpenAI-compatible API.", 1, 65535)
    shutdown_timeout_s: float = _f(
        30.0, "On SIGTERM/SIGINT, how long in-flight requests may run before they are aborted.", 0, 3600
    )
    engine_poll_sleep_s: float = _f(
        default_engine_poll_sleep(),
        "While vLLM's EngineCore and worker wait for each other, each poll sleeps this long instead of "
        f"spinning on a core (0: vLLM's own spin). Default 0.0002 below {SMALL_HOST_CPUS} CPUs, where "
        "the spin starves the API server, else 0.",
        0,
        0.01,
    )
    send_timeout_s: float = _f(30.0, "A response write a client does not take this long ends it.", 1, 3600)
    max_connections: int = _f(4096, "Open connections the API accepts; beyond, 503.", 1, 1_000_000)
    max_connections_per_peer: int = _f(
        1024,
        "Open connections one client address (an IPv6 /64) may hold; beyond, a new one is closed at "
        "once. Behind a gateway or load balancer that connects from one address, raise it to "
        "max_connections.",
        1,
        1_000_000,
    )
    header_timeout_s: float = _f(
        10.0, "A request's line and headers must arrive within this long of its first byte; else 408.", 1, 600
    )
    max_header_bytes: int = _f(
        64 << 10, "Largest request line and headers together; a larger head gets 431.", 4096, 1 << 24
    )
    max_body_bytes: int = _f(64 << 20, "Largest request body; a larger one gets 413.", 1024, 1 << 34)
    body_timeout_s: float = _f(
        30.0, "A request body that sends nothing this long while the app reads it gets 408.", 1, 3600
    )
    vllm: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "Any other key of [server] is a `vllm serve` front-end option (api_key, "
            "served_model_name, chat_template, ...), passed through."
        },
    )


@dataclass(frozen=True)
class AdminConfig:
    """[admin]: the control plane (/metrics, /state, /healthz)."""

    host: str = _f("127.0.0.1", "Address of the control plane. Keep it on loopback unless firewalled.")
    port: int = _f(9400, "Port of the control plane.", 1, 65535)
    token: str = _f("", "When set, /state and /reload require the header 'Authorization: Bearer <token>'.")


@dataclass(frozen=True)
class AdmissionConfig:
    """[admission]: the gate in front of the engine."""

    limit: int = _f(64, "Initial admission limit: requests allowed inside the engine at once.", 1, 100_000)
    max_queue: int = _f(
        1024,
        "Requests that may wait in the gate in all (every class together); beyond it the least "
        "urgent class sheds its newest waiter, or the request is refused with 429.",
        0,
        1_000_000,
    )
    aging_s: float = _f(
        10.0,
        "A class whose oldest waiter waited this long takes one slot per aging_s ahead of more urgent "
        "classes, so lower classes still progress; 0 = pure strict priority.",
        0,
        3600,
    )
    most_urgent_priority: int = _f(
        PRIORITY_MIN,
        "The most urgent priority a client may ask for (lower is more urgent); a request asking for "
        "more is refused with 400. Default: any int64 (clients pick their class).",
        PRIORITY_MIN,
        PRIORITY_MAX,
    )
    default_priority: int = _f(
        0, "The priority of a request that names none (header and body).", PRIORITY_MIN, PRIORITY_MAX
    )
    ttft_wait_share: float = _f(
        0.8,
        "Under a policy that steers to [slo]: the share of its TTFT bound a request may wait in the "
        "gate (its queue deadline is cut to it); the rest is for its prefill and first token.",
        0.01,
        1,
    )
    classes: tuple[PriorityClass, ...] = field(
        default=DEFAULT_CLASSES,
        metadata={"doc": "[admission.classes.NAME]: priority classes (controller/config/classes_table.py)."},
    )

    @property
    def priority_bounds(self) -> PriorityBounds:
        return PriorityBounds(self.most_urgent_priority, self.default_priority)


@dataclass(frozen=True)
class ControlConfig:
    """[control]: the loop that moves the admission limit, the batch cap and the token budget, and
    the normalize stage's bounds and anti-flap settings for every policy."""

    tick_s: float = _f(1.0, "Seconds between two control-loop ticks.", 0.05, 3600)
    policy: str = _f(
        "slo",
        "A registered policy name, or 'module:Class' for a plug-in. The default, 'slo', steers to [slo], "
        "or without it to the throughput knee.",
    )
    window_s: float = _f(10.0, "Length of the engine-stats window the loop observes.", 0.5, 3600)
    history: int = _f(50, "How many recent decisions /state shows.", 1, 10_000)
    limit_max: int = _f(4096, "Ceiling of the admission limit any policy may set.", 1, 1_000_000)
    limit_min: int = _f(1, "Floor of the admission limit any policy may set.", 1, 1_000_000)
    max_num_active_seqs_min: int = _f(
        1,
        "Floor of the batch cap (vLLM's max_num_active_seqs) any policy may set (up to max_num_seqs).",
        1,
        1_000_000,
    )
    tolerance: float | None = _f(
        None,
        "Normalize: ignore changes of at most this fraction of the value in force (0 = off); unset: the "
        "policy's own (slo 0.1, the others 0).",
        0,
        1,
    )
    reverse_after_s: float | None = _f(
        None,
        "Normalize: a move back against a knob's last move, sooner than this after it, is held unless "
        "it halves or doubles the knob (0 = off); unset: the policy's own (slo 30, the others 0).",
        0,
        3600,
    )
    max_step_up: float = _f(
        0.0,
        "Normalize: most a knob rises per tick; < 1 is a fraction of its value, >= 1 absolute, 0 = no limit.",
        0,
        1_000_000,
    )
    max_step_down: float = _f(
        0.0, "Normalize: most a knob falls per tick (as max_step_up); urgent cuts are exempt.", 0, 1_000_000
    )
    stabilization_s: float = _f(
        0.0, "Normalize: a decrease goes only down to the highest recommendation of this window.", 0, 3600
    )
    cost_profile: str = _f(
        "", "Seed of the step-cost model: a profile name or .toml path; '' = a warm-up fit (warmup_s)."
    )
    warmup_s: float = _f(
        20.0,
        "Time budget of the warm-up at startup that fits the step-cost model on this box (synthetic "
        "requests through the engine before it serves; kept in a state file for the next start); "
        "0 = off. Runs when no cost_profile is named.",
        0,
        600,
    )
    params: dict[str, Any] = field(
        default_factory=dict, metadata={"doc": "[control.params]: the policy's own parameters."}
    )

    def build_policy(self, admission: AdmissionConfig, slo: SloTargets | None, max_num_seqs: int) -> Policy:
        """The policy this table names, with its params, started at ``[admission] limit`` under the
        engine's ``max_num_seqs``, steering to ``slo`` where it does: the one construction, which the
        config check runs to validate the file and the daemon, its reloads and the twin run to use it
        (``control/build.py``). Raises ``PolicyError``."""
        return build_policy(
            self.policy, self.params, max_num_seqs=max_num_seqs, initial_limit=admission.limit, slo=slo
        )


@dataclass(frozen=True)
class GuardConfig:
    """[guard]: memory guard and crash recovery (the only things that restart the engine)."""

    consecutive_samples: int = _f(3, "Memory readings in a row below the margin before a restart.", 1, 1000)
    gpu_free_margin_bytes: int = _f(
        1 << 30, "GPU: restart when NVML free memory falls below this.", 0, 1 << 50
    )
    gpu_free_margin_fraction: float = _f(
        0.03,
        "GPU: ... or below this fraction of the GPU's total memory; at a gpu_memory_utilization in "
        "force, at most half of what vLLM leaves free (1 - utilization of the total, or less).",
        0,
        0.5,
    )
    host_available_margin_bytes: int = _f(
        512 << 20, "CPU: restart when the host's available memory falls below this.", 0, 1 << 50
    )
    memory_step_fraction: float = _f(
        0.10,
        "Each memory restart shrinks the setting by the deficit, and by at least this fraction.",
        0.01,
        0.9,
    )
    min_gpu_memory_utilization: float = _f(0.30, "Floor of gpu_memory_utilization.", 0.05, 1.0)
    min_kv_cache_memory_bytes: int = _f(
        16 << 20,
        "Floor of kv_cache_memory_bytes; at least one max_model_len sequence of the model's KV cache "
        "(checked at load), and a value that failed to build is the floor from then on.",
        1 << 20,
        1 << 50,
    )
    drain_timeout_s: float = _f(
        30.0,
        "Before a memory restart, how long in-flight requests may finish; the rest are aborted.",
        0,
        3600,
    )
    max_restarts_per_hour: int = _f(
        5,
        "Crash-recovery budget per hour (reload and memory restarts do not spend it); once spent the "
        "daemon exits non-zero, so that systemd's Restart=on-failure (or the pod's restart) applies.",
        0,
        1000,
    )
    backoff_initial_s: float = _f(
        1.0, "Delay before the first restart after a crash; doubles each time.", 0, 600
    )
    backoff_max_s: float = _f(60.0, "Longest delay between crash restarts.", 0, 3600)
    check_interval_s: float = _f(0.5, "How often the guard checks that the engine is alive.", 0.05, 60)
    cooldown_s: float = _f(
        30.0,
        "After a restart, memory readings are ignored this long; after a memory restart that failed to "
        "build, twice as long at each failure in a row (at most an hour).",
        0,
        3600,
    )
    stall_timeout_s: float = _f(
        60.0, "An engine with requests inside and no step for this long is restarted (0: never).", 0, 3600
    )
    max_restart_wait_s: float = _f(
        120.0, "Restart time a queued request may wait beyond its queue deadline; then 503.", 0, 86400
    )


@dataclass(frozen=True)
class Config:
    """The whole file. ``engine`` holds vLLM engine arguments, passed through unchanged."""

    engine: dict[str, Any]
    server: ServerConfig
    admin: AdminConfig
    admission: AdmissionConfig
    control: ControlConfig
    guard: GuardConfig
    path: Path
    restart_on_reload: bool = False
    """[engine] restart_on_reload: apply [engine] changes on reload through the guard's
    drain-and-restart (queued requests kept). False: they stay pending until the service restarts."""
    slo: SloTargets | None = None
    """[slo] resolved per class (controller/config/slo_table.py); None: the file has no [slo]."""
    overlay: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The command line's tables, laid over the file again at each reload (config/cli_layer.py)."""

    @property
    def max_num_seqs(self) -> int:
        return int(self.engine["max_num_seqs"])


_TABLES: dict[str, type[Any]] = {
    "server": ServerConfig,
    "admin": AdminConfig,
    "admission": AdmissionConfig,
    "control": ControlConfig,
    "guard": GuardConfig,
}
_DICT_FIELDS = {"vllm", "params", "classes"}
"""Fields that hold a table of free-form keys rather than one typed value."""


def _build_table(name: str, raw: dict[str, Any], errors: list[str]) -> Any:
    cls = _TABLES[name]
    keys = {f.name: field_key(f) for f in dataclasses.fields(cls) if f.name not in _DICT_FIELDS}
    kwargs: dict[str, Any] = {}
    free: dict[str, Any] = {}
    for key, value in raw.items():
        if name == "control" and key == "params":
            if isinstance(value, dict):
                kwargs["params"] = dict(value)
            else:
                errors.append("[control] params must be a table: write [control.params]")
        elif name == "admission" and key == "classes":
            kwargs["classes"] = parse_classes(value, errors)
        elif key in keys:
            problems = keys[key].check(name, value)
            errors.extend(problems)
            if not problems:
                kwargs[key] = keys[key].typed(value)
        elif name == "server":
            free[key] = value  # a vLLM front-end option, checked against vLLM's parser below
        else:
            errors.append(f"[{name}] unknown key '{key}': {_suggest(key, list(keys))}")
    if name == "server":
        kwargs["vllm"] = free
    return cls(**kwargs)


def parse_config(data: dict[str, Any], path: Path) -> Config:
    """Validate a parsed TOML document; raise ``ConfigError`` with every problem found."""
    errors: list[str] = []
    known = ["engine", "slo", *_TABLES]
    for key in data:
        if key not in known:
            errors.append(f"unknown table [{key}]: {_suggest(key, known)}")
        elif not isinstance(data[key], dict):
            errors.append(f"{key} = {data[key]!r}: must be a table; write [{key}] on a line of its own")
    engine = _table(data, "engine")
    if "model" not in engine:
        errors.append("[engine] model is missing: set it to a model path or Hugging Face name")
    elif isinstance(engine["model"], str) and not Path(engine["model"]).is_absolute():
        local = path.parent / engine["model"]
        if local.exists() or engine["model"].startswith((".", "models/")):
            engine["model"] = str(local.resolve())
    if "max_num_seqs" not in engine:  # vllm serve's default on this host (vLLM's own resolution)
        from controller.engine.runtime.args import serve_max_num_seqs

        engine["max_num_seqs"] = serve_max_num_seqs(engine)
    restart_on_reload = engine.pop("restart_on_reload", False)  # ours, not a vLLM argument
    if not isinstance(restart_on_reload, bool):
        errors.append(f"[engine] restart_on_reload = {restart_on_reload!r}: must be true or false")
    tables = {name: _build_table(name, _table(data, name), errors) for name in _TABLES}
    errors.extend(non_finite_errors("engine", engine))
    errors.extend(non_finite_errors("server", tables["server"].vllm))
    errors.extend(non_finite_errors("control.params", tables["control"].params))
    slo = parse_slo(data.get("slo"), tables["admission"].classes, errors)
    errors.extend(cost_profile_errors(tables["control"].cost_profile))
    # Lazy: engine.runtime.args imports vLLM (seconds), which only loading a config file needs.
    from controller.engine.runtime.args import engine_table_errors

    # max_num_seqs is checked in cross_table_errors, with the batch cap's own message.
    errors.extend(engine_table_errors({k: v for k, v in engine.items() if k != "max_num_seqs"}, {}))
    own_server_keys = [f.name for f in dataclasses.fields(ServerConfig) if f.name not in _DICT_FIELDS]
    errors.extend(server_option_errors(tables["server"].vllm, own_server_keys))
    if not errors:
        errors.extend(cross_table_errors(engine, tables))
        need = kv_floor_need(engine, path.parent)
        floor = tables["guard"].min_kv_cache_memory_bytes
        if need is not None and floor < need and "min_kv_cache_memory_bytes" not in _table(data, "guard"):
            # the default floor, not the operator's: raised to what vLLM can build, so that `serve
            # MODEL --kv-cache-memory-bytes N` starts with no [guard] table (only a value set below
            # one sequence is an error)
            tables["guard"] = dataclasses.replace(tables["guard"], min_kv_cache_memory_bytes=need)
        errors.extend(kv_floor_errors(engine, tables["guard"], path.parent))
    if not errors:
        errors.extend(policy_errors(engine, tables, slo))
    if errors:
        raise ConfigError(scrub(errors, data))  # logged and answered: no secret's value in them
    return Config(
        engine=engine,
        path=path,
        restart_on_reload=restart_on_reload is True,
        slo=slo,
        **tables,
    )


def _table(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name, {})
    return dict(value) if isinstance(value, dict) else {}  # not a table: reported in parse_config


def load_config(path: Path = DEFAULT_CONFIG) -> Config:
    """Read and validate ``path``."""
    return parse_config(read_toml(path), path)


def read_toml(path: Path) -> dict[str, Any]:
    """The parsed file, or a ``ConfigError`` that says why it cannot be read."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read config file {path}: {exc.strerror}; pass --config PATH"]) from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML ({exc}); fix the syntax at that line"]) from exc


def describe(config: Config, *, secrets: bool = False) -> dict[str, Any]:
    """The effective config as plain data (check-config, /state), secrets redacted; ``secrets=True``
    keeps them, for comparing two configs (the reload diff), never for showing."""
    out: dict[str, Any] = {"engine": {**config.engine, "restart_on_reload": config.restart_on_reload}}
    for name in _TABLES:
        out[name] = dataclasses.asdict(getattr(config, name))
    out["slo"] = describe_slo(config.slo, config.admission.classes)
    return out if secrets else dict(redact(out))
