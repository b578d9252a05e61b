"""docs/configuration.md, generated from the keys themselves: every key's doc and bounds come from its
``Key`` (``fields.py``): the dataclass tables' fields (``doc_field`` in ``load.py``, their defaults
too), the class keys of ``classes_table.py`` and the ``[slo]`` keys of ``slo_table.py``; whether a key
applies live on reload comes from ``diff.py``. The keys are the one source; this module only lays them
out, and a unit test fails when the committed file and the code disagree.

    python -m controller.config.reference            # rewrite docs/configuration.md
    python -m controller.config.reference --check    # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from controller.admission.classes import DEFAULT_CLASSES, PriorityClass
from controller.config.classes_table import KEYS as CLASS_KEYS
from controller.config.diff import LIVE_TABLES
from controller.config.fields import Key, field_key
from controller.config.load import _DICT_FIELDS, _TABLES, SMALL_HOST_CPUS
from controller.config.slo_table import KEYS as SLO_KEYS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python -m controller.config.reference"

HOST_DEPENDENT = {("server", "engine_poll_sleep_s"): f"`0.0002` below {SMALL_HOST_CPUS} CPUs, else `0.0`"}
"""Defaults computed from the host at import: written as the rule, so the file is the same everywhere."""

SEE_ALSO = {
    "server": "Data-plane behaviour (API keys, keep-alive, body limits, the poll sleep's measurements): "
    "[operations.md](operations.md#the-data-plane).",
    "admin": "The endpoints, the token and the Host check: [operations.md](operations.md#the-control-plane).",
    "admission": "What a request meets in the gate, in order: [policies.md](policies.md#the-gate).",
    "control": "The loop, the step-cost model, the warm-up and the capacity gauges: "
    "[policies.md](policies.md#the-loop).",
    "guard": "What a restart does and which memory setting shrinks: "
    "[operations.md](operations.md#the-memory-guard).",
}

ENGINE_INTRO = """\
vLLM engine arguments, passed through: any `vllm serve` engine argument under its own name
(`--max-num-seqs` is `max_num_seqs`), checked against vLLM's `AsyncEngineArgs` at load. A relative
`model` path is resolved against the config file's folder. What the daemon adds or reads:"""

ENGINE_KEYS: tuple[tuple[str, str, str, str], ...] = (
    ("`model`", "required", "restart", "a model path or Hugging Face name"),
    (
        "`max_num_seqs`",
        "`vllm serve`'s: 1024 on an H100/H200-class GPU, 256 on a smaller one, 128 per CPU rank",
        "restart",
        "the hard ceiling of the batch cap; it sizes vLLM's buffers",
    ),
    (
        "`max_num_batched_tokens`",
        "vLLM's",
        "restart",
        "the token budget's ceiling (it sizes the engine's buffers)",
    ),
    ("`max_num_scheduled_tokens`", "`max_num_batched_tokens`", "restart", "the token budget's initial value"),
    (
        "`dtype`",
        '`"auto"`',
        "restart",
        "on an x86 CPU `auto` resolves to `bfloat16` where the CPU computes bf16 natively (`avx512_bf16` or "
        "`amx_bf16`), else `float32`; vLLM's own `auto` elsewhere; `/state` shows `engine.dtype_reason`",
    ),
    (
        "`kv_cache_memory_bytes` / `gpu_memory_utilization`",
        "vLLM's",
        "restart",
        "the memory knob; only the memory guard lowers it. On a CPU set `kv_cache_memory_bytes`: vLLM's "
        "default sizing fails there (the NUMA node reports less memory than `free` shows)",
    ),
    (
        "`enable_prefix_caching`",
        "vLLM's (on)",
        "restart",
        "the step-cost model and the gate's TTFT prediction count only the prefill tokens the engine "
        "computes",
    ),
    (
        "`restart_on_reload`",
        "`false`",
        "live",
        "ours, not vLLM's: apply changed `[engine]` keys on reload through the guard's drain-and-restart "
        "(queued requests kept); `false`: they wait in `/state` `pending_config_changes` for a service "
        "restart",
    ),
    (
        "`scheduler_cls`, `max_num_active_seqs`",
        "reserved",
        "",
        "the daemon installs its own scheduler subclass to move the batch cap",
    ),
)
"""``[engine]`` is vLLM's table: these are the keys the daemon adds, defaults or reads itself."""

ENGINE_PARALLEL = """\
Parallel keys (`tensor_parallel_size`, `pipeline_parallel_size`, `data_parallel_size`,
`distributed_executor_backend`, ...) pass through unchanged; at load they are built into vLLM's
`ParallelConfig`, so vLLM's own cross-checks run before any engine is touched (`"ray"` needs Ray
installed; `"external_launcher"` is refused for a server). With `data_parallel_size > 1` the batch cap
applies to every data-parallel engine and `max_num_seqs` is per engine."""

CONTROL_PARAMS = """\
The policy's own parameters, free keys checked by the policy when the file loads; each policy's
parameters and defaults: [policies.md](policies.md#the-policies) and the class docstrings in
`policies/`. Live on reload."""


def _fmt(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def _range(key: Key) -> str:
    if key.choices:
        return ", ".join(map(_fmt, key.choices))
    if key.lo is None and key.hi is None:
        return ""
    return f"{'' if key.lo is None else key.lo} to {'' if key.hi is None else key.hi}".strip()


def _row(*cells: str) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


HEADER = ("| key | default | range | reload | meaning |", "| --- | --- | --- | --- | --- |")


def _typed_table(name: str, cls: type[Any]) -> list[str]:
    reload = "live" if name in LIVE_TABLES else "restart"
    summary = (cls.__doc__ or "").strip().partition(": ")[2]  # "[server]: the data plane ..." -> the rest
    lines = [f"## `[{name}]`", "", summary[:1].upper() + summary[1:], ""]
    lines += [*HEADER]
    for f in dataclasses.fields(cls):
        if f.name in _DICT_FIELDS:
            continue
        default = HOST_DEPENDENT.get((name, f.name)) or _fmt(f.default)
        key = field_key(f)
        lines.append(_row(f"`{f.name}`", default, _range(key), reload, key.doc))
    if name == "server":
        lines.append(_row("*any other key*", "", "", reload, _doc(cls, "vllm")))
    lines += ["", SEE_ALSO[name], ""]
    return lines


def _doc(cls: type[Any], field_name: str) -> str:
    return str(next(f.metadata["doc"] for f in dataclasses.fields(cls) if f.name == field_name))


def _classes() -> list[str]:
    reload = "live" if "admission" in LIVE_TABLES else "restart"
    defaults = {f.name: f.default for f in dataclasses.fields(PriorityClass)}
    builtin = " / ".join(c.name for c in DEFAULT_CLASSES)
    lines = [
        "## `[admission.classes.NAME]`",
        "",
        "Priority classes: each owns a contiguous range of vLLM's `priority` values (the body's `priority` "
        "or the `X-Vllm-Priority` header; lower is more urgent), and together the ranges cover every "
        "integer once. Without any `[admission.classes.NAME]` table the built-in classes "
        f"({builtin}) apply; a file that names one class replaces them all, and a key a class table omits "
        "takes the *in a class table* default, not the built-in class's value.",
        "",
        f"| key | in a class table | built-in ({builtin}) | range | reload | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key in CLASS_KEYS.values():
        shown = " / ".join(_fmt(getattr(c, key.name)) for c in DEFAULT_CLASSES)
        lines.append(_row(f"`{key.name}`", _fmt(defaults[key.name]), shown, _range(key), reload, key.doc))
    return [*lines, ""]


def _slo() -> list[str]:
    lines = [
        "## `[slo]`",
        "",
        "The latency a request must meet: it is good when both bounds hold. The table is optional "
        "(without it the `slo` policy steers to the throughput knee and no class may override a bound); "
        "with it both keys are required. Each class resolves to its own `slo_ttft_s` / `slo_tpot_s` "
        "where it sets one; `check-config` and `/state` show every class resolved, with its "
        "`wait_bound_s` (the shorter of its queue deadline and its TTFT bound).",
        "",
        *HEADER,
    ]
    reload = "live" if "slo" in LIVE_TABLES else "restart"
    for key in SLO_KEYS.values():
        lines.append(_row(f"`{key.name}`", "required", _range(key), reload, key.doc))
    return [*lines, ""]


def render() -> str:
    """The whole page."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from the keys' own docs in controller/config/:",
        "edit them there, then regenerate. -->",
        "",
        "Every table and key of `config.toml`. Unknown keys are errors with a did-you-mean; `nan` and `inf` "
        "are refused everywhere; `check-config` prints every problem (key, value, fix) at once. **reload**: "
        "`live` keys apply at once on SIGHUP or `POST /reload` without failing a request; `restart` keys are "
        "reported as pending until the daemon restarts (`[engine]` ones apply through a guarded engine "
        "restart with `restart_on_reload = true`). Ranges are inclusive.",
        "",
        "## `[engine]`",
        "",
        ENGINE_INTRO,
        "",
        "| key | default | reload | meaning |",
        "| --- | --- | --- | --- |",
        *(_row(*cells) for cells in ENGINE_KEYS),
        "",
        ENGINE_PARALLEL,
        "",
    ]
    for name, cls in _TABLES.items():
        lines += _typed_table(name, cls)
        if name == "admission":
            lines += _classes() + _slo()
        if name == "control":
            lines += ["## `[control.params]`", "", CONTROL_PARAMS, ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale, write nothing")
    parser.add_argument("--out", type=Path, default=DOC)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not args.out.is_file() or args.out.read_text() != text
        if stale:
            print(f"{args.out} is stale: run `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
