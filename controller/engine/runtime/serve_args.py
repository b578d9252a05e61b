"""``vllm-autopilot serve [MODEL] [OPTIONS]`` read by vLLM's own ``vllm serve`` parser.

The names, the ``--help`` text and the errors (exit 2) are vLLM's, and a YAML ``--config`` is expanded
by vLLM's parser as ``vllm serve`` does. What comes back is only what the command line *gave*: the
parser records each option it takes a value for, so ``--port 8000`` overrides a file's ``port = 9000``
although 8000 is vLLM's default (comparing against the defaults could not tell), and an option left
out never hides the file's value.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

_EPILOG = (
    "For full list:            vllm-autopilot serve --help=all\n"
    "For a section:            vllm-autopilot serve --help=ModelConfig    (case-insensitive)\n"
    "For a flag:               vllm-autopilot serve --help=max-model-len  (_ or - accepted)\n"
    "Our own options:          vllm-autopilot serve --help=autopilot\n"
)
_UNSUPPORTED = {
    "headless": "the daemon runs its engine behind its own API server",
    "api_server_count": "the daemon runs one API server, in front of its admission gate",
    "config": "write --config PATH (a .toml is the daemon's file, any other vLLM's YAML)",
}
"""Serve options the daemon cannot honour, and why."""
_ENGINE_KEYS = frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


class _RecordingParser(FlexibleArgumentParser):
    """vLLM's serve parser that notes each option the command line gave, with its strings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given: dict[str, list[list[str]]] = {}

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        values = super()._get_values(action, arg_strings)  # vLLM's types and choices: its errors
        if action.option_strings or arg_strings:  # an absent optional positional is not given
            self.given.setdefault(action.dest, []).append(list(arg_strings))
        return values


@dataclasses.dataclass(frozen=True)
class GivenOption:
    """One option of the command line, as a config table holds it."""

    table: str
    """``engine`` (an engine argument), ``server`` (a front-end option), or ``own`` (ours)."""
    value: Any
    """The parsed value when it is plain data; else the strings typed (a JSON ``--compilation-config``),
    which the table's validation hands to the same vLLM type again."""
    flag: str
    """The option as ``--help`` names it, for error messages."""


def serve_parser(add_own: Callable[[argparse.ArgumentParser], None]) -> _RecordingParser:
    """A fresh ``vllm serve`` parser named ``vllm-autopilot serve``, with ``add_own``'s options."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser

    parser = _RecordingParser(
        prog="vllm-autopilot serve",
        usage="vllm-autopilot serve [model_tag] [options]",
        description="Serve a model as `vllm serve` does, behind vllm-autopilot's admission gate and "
        "control loop. Every `vllm serve` option is accepted; --config FILE.toml is the daemon's own "
        "file (command line > YAML --config > TOML file > defaults).",
        epilog=_EPILOG,
    )
    make_arg_parser(parser)
    add_own(parser)
    return parser


def parse_serve_argv(
    argv: Sequence[str], add_own: Callable[[argparse.ArgumentParser], None]
) -> dict[str, GivenOption]:
    """The options ``argv`` gives, by destination; a bad one exits 2 with vLLM's message."""
    parser = serve_parser(add_own)
    own = {a.dest for g in parser._action_groups if g.title == "autopilot" for a in g._group_actions}
    try:
        ns = parser.parse_args(list(argv))
    except ValueError as exc:  # vLLM's own checks (a YAML --config that names no file, ...)
        parser.error(str(exc))
    actions = {a.dest: a for a in parser._actions}
    given: dict[str, GivenOption] = {}
    for dest, strings in parser.given.items():
        action = actions[dest]
        if dest in _UNSUPPORTED:
            parser.error(f"argument {_flag(action)}: not supported here: {_UNSUPPORTED[dest]}")
        engine = dest in _ENGINE_KEYS or dest == "model_tag"
        table = "own" if dest in own else "engine" if engine else "server"
        given[dest] = GivenOption(table, _value(action, getattr(ns, dest), strings), _flag(action))
    return given


def default_model() -> str:
    """The model ``vllm serve`` serves when none is named."""
    return str(AsyncEngineArgs.model)


def _flag(action: argparse.Action) -> str:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0] if longs else action.dest


def _plain(value: Any) -> bool:
    """Whether ``value`` is data a TOML table could hold (vLLM parses some options into objects)."""
    if isinstance(value, str | bool | int | float):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _value(action: argparse.Action, parsed: Any, strings: list[list[str]]) -> Any:
    if _plain(parsed):
        return list(parsed) if isinstance(parsed, tuple) else parsed
    many = action.nargs in ("+", "*")
    typed = [s if many else s[0] for s in strings if s or many]
    if isinstance(action, argparse._AppendAction):
        return typed
    return typed[-1] if typed else parsed  # the last one given wins, as in argparse
