"""[engine] and [server] tables -> vLLM's own argument objects.

config.toml uses vLLM's engine-argument names (``AsyncEngineArgs`` fields) so that a ``vllm serve``
user's knowledge carries over; the extra keys of ``[server]`` are ``vllm serve`` front-end options.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs

# Chosen by the daemon itself; a user setting them would break the batch cap or the serving model.
_RESERVED = {
    "scheduler_cls": "the daemon installs its own scheduler subclass for the runtime batch cap",
    "max_num_active_seqs": "the batch cap is the daemon's to move; set [control] and max_num_seqs",
}
_SERVER_OWNED = {"host", "port", "model", "model_tag", "headless", "api_server_count", "config"}


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm-autopilot"))


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


def engine_table_errors(engine: dict[str, Any], server_extra: dict[str, Any]) -> list[str]:
    """Names that vLLM would not accept, each with a fix."""
    errors = []
    for key in engine:
        if key in _RESERVED:
            errors.append(f"[engine] {key} = {engine[key]!r}: reserved, {_RESERVED[key]}; remove it")
        elif key not in _engine_keys():
            errors.append(_unknown("engine", key, _engine_keys()))
    for key in server_extra:
        if key in _engine_keys():
            errors.append(f"[server] {key}: an engine argument; move it to [engine]")
        elif key not in _frontend_keys():
            errors.append(_unknown("server", key, _frontend_keys()))
    return errors


def serve_namespace(engine: dict[str, Any], server: dict[str, Any]) -> argparse.Namespace:
    """The namespace ``vllm serve`` would build for the same settings (read by vLLM's app)."""
    args = _parser().parse_args([])
    for key, value in {**engine, **server}.items():
        setattr(args, key, value)
    args.model_tag = engine["model"]  # the positional model argument is not copied by itself
    return args


def engine_args(args: argparse.Namespace) -> AsyncEngineArgs:
    return AsyncEngineArgs.from_cli_args(args)
