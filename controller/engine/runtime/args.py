"""[engine] and [server] tables -> vLLM's own argument objects.

config.toml uses vLLM's engine-argument names (``AsyncEngineArgs`` fields) so that a ``vllm serve``
user's knowledge carries over; the extra keys of ``[server]`` are ``vllm serve`` front-end options.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import types
from typing import Annotated, Any, NoReturn

import structlog
from vllm.config import SchedulerConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser

from controller.engine.runtime.dtype import platform_dtype
from controller.engine.runtime.parallel import parallel_errors

log = structlog.get_logger(__name__)

# Chosen by the daemon itself; a user setting them would break the batch cap or the serving model.
_RESERVED = {
    "scheduler_cls": "the daemon installs its own scheduler subclass for the runtime batch cap",
    "max_num_active_seqs": "the batch cap is the daemon's to move; set [control] and max_num_seqs",
}
SERVE_USAGE = UsageContext.OPENAI_API_SERVER
"""The usage context ``vllm serve`` builds its engine in (``entrypoints/launchers/api_server``): it
picks vLLM's defaults of ``max_num_batched_tokens`` and ``max_num_seqs`` for the platform (8192 and
1024 on an H100/H200-class GPU, 16384 from 160 GB), where the default context takes 2048 and 128."""

_SERVER_OWNED = {"host", "port", "model", "model_tag", "headless", "api_server_count", "config"}


class _Parser(FlexibleArgumentParser):
    """vLLM's parser, raising instead of exiting, so that a bad value becomes a config error."""

    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser

    return make_arg_parser(_Parser(prog="vllm-autopilot"))


@functools.cache
def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in _parser()._actions if a.option_strings and a.dest != "help"}


@functools.cache
def _engine_keys() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


@functools.cache
def _frontend_keys() -> frozenset[str]:
    dests = {a.dest for a in _parser()._actions}
    return frozenset(dests - _engine_keys() - _SERVER_OWNED - {"help"})


def _unknown(table: str, key: str, known: frozenset[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"did you mean '{close[0]}'?" if close else "see `vllm serve --help` for the names"
    kind = "engine argument" if table == "engine" else "server option"
    return f"[{table}] unknown key '{key}': not a vLLM {kind}; {hint}"


# -- values through vLLM's own parser types ----------------------------------------------------------
# A TOML value is turned into the strings `vllm serve` would get on its command line and handed to the
# option's own argparse action, so it takes exactly the form vLLM's parser gives it: a string where the
# parser makes a list (``api_key``) becomes a one-item list, never a string that vLLM iterates by
# character. The action is called directly rather than through ``parse_args``: a value that starts
# with a dash or holds a dot stays a value.

_PLAIN_NAMES = {str: "a string", int: "an integer", float: "a number"}
_SIZE_NAMES = {
    "human_readable_int": 'an integer (or a size such as "64M")',
    "human_readable_int_or_auto": 'an integer, a size such as "2K", or "auto"',
}


def _base_type(action: argparse.Action) -> Any:
    """The type under vLLM's ``optional_type`` / ``parse_type`` wrappers (``str`` for api_key)."""
    kind: Any = action.type
    while getattr(kind, "__name__", "") in ("_optional_type", "_parse_type") and kind.__closure__:
        kind = kind.__closure__[0].cell_contents
    return str if kind is None else kind


def _many(action: argparse.Action) -> bool:
    return action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)


def _expected(action: argparse.Action) -> str:
    """What a key takes, in TOML words (the fix an error names)."""
    if action.nargs == 0:
        return "true or false"
    kind = _base_type(action)
    one = _PLAIN_NAMES.get(kind) or _SIZE_NAMES.get(getattr(kind, "__name__", ""), "")
    one = one or "a table or a string as `vllm serve` takes it"
    if action.choices:
        one += f" (one of {', '.join(map(str, action.choices))})"
    return f"{one}, or a list of them" if _many(action) else one


def _token(action: argparse.Action, item: Any) -> str:
    """One command-line string for ``item``; TOML types that vLLM's parser would misread are refused."""
    kind = _base_type(action)
    wrong = isinstance(item, bool) or (
        kind in _PLAIN_NAMES
        and not isinstance(item, str if kind is str else (int, float) if kind is float else kind)
    )
    if wrong:
        raise argparse.ArgumentError(action, f"{item!r} is not {_PLAIN_NAMES.get(kind, 'a value')}")
    return json.dumps(item) if isinstance(item, (dict, list)) else str(item)


def _apply(ns: argparse.Namespace, key: str, value: Any) -> None:
    """Set ``key`` on ``ns`` as ``vllm serve --key VALUE`` would; raises ``argparse.ArgumentError``."""
    action = _actions().get(key)
    if action is None:  # an engine argument vLLM's parser does not expose: passed as it is
        setattr(ns, key, value)
        return
    parser = _parser()
    option = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise argparse.ArgumentError(action, f"{value!r} is not true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            action(parser, ns, None, option if value else "--no-" + option[2:])
        else:  # store_true / store_false: the other value is the default's
            setattr(ns, key, value)
        return
    items = value if isinstance(value, list) and _many(action) else [value]
    tokens = [_token(action, item) for item in items]
    if isinstance(action, argparse._AppendAction):
        for token in tokens:
            action(parser, ns, parser._get_values(action, [token]), option)
    elif tokens or action.nargs not in ("+", "*"):
        action(parser, ns, parser._get_values(action, tokens), option)


# -- values through vLLM's own config classes ---------------------------------------------------------
# The bounds of an engine value live on vLLM's config dataclasses (``CacheConfig.gpu_memory_utilization``
# is ``Field(gt=0, le=1)``). Each field is checked alone against its type and bounds, with pydantic as
# vLLM does, without building the classes: building them cross-checks fields this file may not set, and
# building the whole engine config loads the model's own config from disk or the Hub.
_CONFIG_CLASSES = ("CacheConfig", "SchedulerConfig", "ParallelConfig", "ModelConfig", "LoadConfig")


@functools.cache
def _field_check(key: str) -> tuple[str, Any] | None:
    """(config class name, pydantic TypeAdapter) for the vLLM config field ``key``, if one checks it."""
    import vllm.config
    from pydantic import TypeAdapter

    for name in _CONFIG_CLASSES:
        info = getattr(getattr(vllm.config, name), "__pydantic_fields__", {}).get(key)
        if info is None:
            continue
        try:
            return name, TypeAdapter(Annotated[info.annotation, info])
        except Exception:  # a type pydantic cannot check alone (torch.dtype, callables): vLLM will
            return None
    return None


def _bounds_error(key: str, value: Any) -> str | None:
    """vLLM's own refusal of an engine value that its parser accepted (``gpu_memory_utilization = 1.5``)."""
    from pydantic import ValidationError

    check = _field_check(key) if value is not None else None
    if check is None:
        return None
    try:
        check[1].validate_python(value)
    except ValidationError as exc:
        return f"{check[0]}.{key}: {exc.errors()[0]['msg']}"
    return None


def _value_error(table: str, key: str, value: Any) -> str | None:
    ns = argparse.Namespace()
    try:
        _apply(ns, key, value)
    except argparse.ArgumentError as exc:
        action = _actions()[key]
        option, takes = action.option_strings[0], _expected(action)
        return f"[{table}] {key} = {value!r}: {exc.message}; vLLM's {option} takes {takes}"
    if table == "engine" and (problem := _bounds_error(key, getattr(ns, key, value))):
        return f"[{table}] {key} = {value!r}: vLLM refuses it ({problem}); use a value it accepts"
    return None


def engine_table_errors(engine: dict[str, Any], server_extra: dict[str, Any]) -> list[str]:
    """Names that vLLM would not accept, and values its parser would not, each with a fix."""
    errors = []
    for key in engine:
        if key in _RESERVED:
            errors.append(f"[engine] {key} = {engine[key]!r}: reserved, {_RESERVED[key]}; remove it")
        elif key not in _engine_keys():
            errors.append(_unknown("engine", key, _engine_keys()))
        elif problem := _value_error("engine", key, engine[key]):
            errors.append(problem)
    if not errors:  # each value passed alone: now the parallel settings together, as vLLM parsed them
        parsed = vars(serve_namespace({"model": "", **engine}, {}))
        errors.extend(parallel_errors({key: parsed[key] for key in engine}))
    for key in server_extra:
        if key in _engine_keys():
            errors.append(f"[server] {key}: an engine argument; move it to [engine]")
        elif key not in _frontend_keys():
            errors.append(_unknown("server", key, _frontend_keys()))
        elif problem := _value_error("server", key, server_extra[key]):
            errors.append(problem)
    return errors


def serve_namespace(engine: dict[str, Any], server: dict[str, Any]) -> argparse.Namespace:
    """The namespace ``vllm serve`` would build for the same settings (read by vLLM's app)."""
    args = _parser().parse_args([])
    for key, value in {**engine, **server}.items():
        _apply(args, key, value)
    args.model_tag = engine["model"]  # the positional model argument is not copied by itself
    return args


def engine_args(args: argparse.Namespace) -> AsyncEngineArgs:
    """vLLM's engine arguments for ``args``, with ``dtype`` "auto" resolved for this CPU (dtype.py)."""
    eargs = AsyncEngineArgs.from_cli_args(args)
    choice = platform_dtype(getattr(args, "dtype", None))
    eargs.dtype = choice.dtype
    log.info("engine_dtype", dtype=choice.dtype, reason=choice.reason)
    return eargs


_BATCH_DEFAULT_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "performance_mode",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
)
"""The [engine] keys vLLM's default of ``max_num_seqs`` depends on."""


def serve_max_num_seqs(engine: dict[str, Any]) -> int:
    """The ``max_num_seqs`` ``vllm serve`` takes on this host when none is given, by vLLM's own
    resolution (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` in ``SERVE_USAGE``):
    1024 on an H100/H200-class GPU, 256 on a smaller one, 128 per rank on a CPU, doubled in the
    throughput performance mode, never above the token budget. The daemon needs it at config load,
    before any engine (the batch cap's ceiling); the model's length does not move it."""
    eargs = AsyncEngineArgs()
    for key in _BATCH_DEFAULT_KEYS:
        if engine.get(key) is not None:
            setattr(eargs, key, engine[key])
    model = types.SimpleNamespace(max_model_len=1 << 30, is_multimodal_model=False, is_mm_prefix_lm=False)
    try:
        eargs._set_default_max_num_seqs_and_batched_tokens_args(
            SERVE_USAGE, model, types.SimpleNamespace(use_batched_dp_moe=False)
        )
    except (TypeError, ValueError):  # a value of the wrong type: the table's checks name it
        return int(SchedulerConfig.DEFAULT_MAX_NUM_SEQS)
    return int(eargs.max_num_seqs)
