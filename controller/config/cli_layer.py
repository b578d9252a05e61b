"""``vllm-autopilot serve [MODEL] [OPTIONS]``: the command line laid over the TOML file.

Precedence, highest first: an option on the command line; a vLLM YAML ``--config`` (vLLM's parser
expands it into command-line options, so it counts as given); the daemon's TOML file; the defaults
(vLLM's for [engine] and the front end, ours for our tables). Only options the command line gave
override the file (``controller/engine/runtime/serve_args.py`` records them as it parses).

``--config`` names our file when it ends in ``.toml`` and vLLM's YAML otherwise, so
``serve --config /etc/vllm-autopilot/config.toml`` (the systemd unit, deploy/k8s/) reads our TOML file.
Without a TOML file there is no file layer: the tables take their documented defaults, and the model is
vLLM's default when none is named. The layered tables go through ``parse_config`` like the file's own,
so a bad value gets the file's message, with the flag that set it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.config.load import Config, ConfigError, parse_config, read_toml

NO_FILE = Path(os.devnull)
"""``Config.path`` when only the command line configures: it reads as an empty file, so a reload
re-applies the command line alone."""

DEFAULTS = "defaults from the command line"
"""An overlay entry (not a table): keys the command line implies rather than sets (the served name of
a model path it resolved), laid below the file's keys instead of over them."""

_OWN: tuple[tuple[str, type, str, str, str], ...] = (
    ("--admin-port", int, "admin", "port", "Port of the control plane (/metrics, /state, the page)."),
    ("--admin-host", str, "admin", "host", "Address of the control plane; keep it on loopback."),
    ("--policy", str, "control", "policy", "Control policy: a registered name or 'module:Class'."),
    ("--slo-ttft", float, "slo", "ttft_s", "SLO: longest time to first token, seconds ([slo] ttft_s)."),
    ("--slo-tpot", float, "slo", "tpot_s", "SLO: longest time per output token, seconds ([slo] tpot_s)."),
)
"""Our own flags: the option, its type, and the table key it sets."""
_OWN_KEYS = {flag[2:].replace("-", "_"): (table, key) for flag, _, table, key, _ in _OWN}
_SERVER_KEYS = {"host", "port"}  # vLLM's --host/--port are [server]'s own keys, not free options


def add_own_options(parser: argparse.ArgumentParser) -> None:
    """vllm-autopilot's options, as their own group beside vLLM's (``--help=autopilot``)."""
    group = parser.add_argument_group(
        "autopilot", "vllm-autopilot's own options; they override the TOML file's table keys."
    )
    for flag, kind, table, key, doc in _OWN:
        group.add_argument(flag, type=kind, help=f"{doc} Sets [{table}] {key}.")


def split_toml(argv: Sequence[str]) -> tuple[Path | None, list[str]]:
    """Our ``--config FILE.toml`` out of ``argv``; the rest (a YAML ``--config`` too) is vLLM's."""
    args: list[str] = []
    for arg in argv:  # --config=PATH as --config PATH: vLLM's parser expands only the latter
        args.extend(arg.split("=", 1) if arg.startswith("--config=") else [arg])
    found = [i for i, a in enumerate(args[:-1]) if a == "--config" and args[i + 1].lower().endswith(".toml")]
    if len(found) > 1:
        raise ConfigError(["more than one --config FILE.toml: name one file"])
    if not found:
        return None, args
    i = found[0]
    return Path(args[i + 1]), args[:i] + args[i + 2 :]


def command_line_overlay(argv: Sequence[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The tables ``argv`` sets, and the flag behind each ``[table] key``; vLLM's parser exits 2 on a
    bad option."""
    from controller.engine.runtime.serve_args import parse_serve_argv  # lazy: imports vLLM

    overlay: dict[str, dict[str, Any]] = {}
    flags: dict[str, str] = {}
    given = parse_serve_argv(argv, add_own_options)
    for dest, option in sorted(given.items(), key=lambda item: item[0] == "model_tag"):  # positional last
        if option.table == "own":
            table, key = _OWN_KEYS[dest]
        elif dest in _SERVER_KEYS:
            table, key = "server", dest
        elif dest == "model_tag":  # the positional model beats --model, as in `vllm serve`
            table, key = "engine", "model"
        else:
            table, key = option.table, dest
        value = _local_model(option.value) if key == "model" and table == "engine" else option.value
        overlay.setdefault(table, {})[key] = value
        flags[f"[{table}] {key}"] = option.flag
    model = overlay.get("engine", {}).get("model")
    named = "served_model_name" in overlay.get("engine", {})
    if model is not None and not named and (written := given_model(given)) not in (None, model):
        # `vllm serve models/x` answers to "models/x" (its served name is the model as written); the
        # path we resolved must not rename it, or a client of the same command gets 404. Below a
        # served_model_name the file sets: a default, not a flag.
        overlay[DEFAULTS] = {"engine": {"served_model_name": [written]}}
    return overlay, flags


def given_model(given: dict[str, Any]) -> str | None:
    """The model as the command line wrote it (the positional beats ``--model``)."""
    for dest in ("model_tag", "model"):
        option = given.get(dest)
        if option is not None and option.table != "own" and isinstance(option.value, str):
            return str(option.value)
    return None


def _local_model(model: Any) -> Any:
    """A model path on the command line is relative to the working directory, as for `vllm serve`
    (the file's own relative model stays relative to the file)."""
    if isinstance(model, str) and (Path(model).exists() or model.startswith((".", "models/"))):
        return str(Path(model).resolve())
    return model


def load_layered(path: Path, overlay: dict[str, dict[str, Any]]) -> Config:
    """The file at ``path`` (``NO_FILE``: none) with ``overlay``'s keys over its tables, validated as
    one file; a reload calls it again with the same overlay."""
    data = read_toml(path)
    for table, values in overlay.get(DEFAULTS, {}).items():  # below the file's own keys
        current = data.get(table, {})
        data[table] = {**values, **current} if isinstance(current, dict) else current
    for table, values in overlay.items():
        if table == DEFAULTS:
            continue
        current = data.get(table, {})
        data[table] = {**current, **values} if isinstance(current, dict) else current  # not a table: reported
    config = parse_config(data, path)
    return dataclasses.replace(config, overlay=overlay)


def serve_config(argv: Sequence[str]) -> Config:
    """The config ``vllm-autopilot serve ARGV`` runs with; ``ConfigError`` names each bad key and the
    flag that set it."""
    path, rest = split_toml(argv)
    overlay, flags = command_line_overlay(rest)
    if path is None and "model" not in overlay.get("engine", {}):
        from controller.engine.runtime.serve_args import default_model  # lazy: imports vLLM

        overlay.setdefault("engine", {})["model"] = default_model()
    try:
        return load_layered(path or NO_FILE, overlay)
    except ConfigError as exc:
        raise ConfigError([_with_flag(error, flags) for error in exc.errors]) from exc


def _with_flag(error: str, flags: dict[str, str]) -> str:
    for where, flag in flags.items():
        if error.startswith((f"{where} ", f"{where}:")):
            return f"{error} (from {flag})"
    return error
