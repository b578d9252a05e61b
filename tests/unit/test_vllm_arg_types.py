"""[server] and [engine] values reach vLLM through vLLM's own parser types.

Setting TOML values on vLLM's namespace directly put the string ``"secret-key-42"`` where vLLM's parser
makes a list, so vLLM iterated its characters: the key was refused and any one character of it
accepted. These tests build the namespace as the daemon does and compare it with what ``vllm serve``
would build from the same options on its command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from controller.config.load import ConfigError, load_config
from controller.engine.runtime.args import _parser, engine_table_errors, serve_namespace
from tests.helpers import write_config

MODEL = {"model": "/models/tiny"}


def _cli(*argv: str) -> argparse.Namespace:
    """What `vllm serve` makes of these options."""
    return _parser().parse_args(list(argv))


def _list_options() -> list[argparse.Action]:
    return [
        a
        for a in _parser()._actions
        if a.option_strings and (a.nargs in ("+", "*") or isinstance(a, argparse._AppendAction))
    ]


def _flag_options() -> list[argparse.Action]:
    return [a for a in _parser()._actions if a.option_strings and a.nargs == 0 and a.dest != "help"]


def _takes_int(action: argparse.Action) -> bool:
    try:
        return callable(action.type) and action.type("1") == 1
    except (ValueError, TypeError):
        return False


def test_api_key_string_becomes_a_one_key_list() -> None:
    args = serve_namespace(MODEL, {"api_key": "secret-key-42"})
    assert args.api_key == ["secret-key-42"]
    assert args.api_key == _cli("--api-key", "secret-key-42").api_key


def test_api_key_list_keeps_every_key() -> None:
    assert serve_namespace(MODEL, {"api_key": ["a", "b"]}).api_key == ["a", "b"]


def test_api_key_starting_with_a_dash_is_a_value_not_an_option() -> None:
    assert serve_namespace(MODEL, {"api_key": "--not-an-option.x"}).api_key == ["--not-an-option.x"]


def test_every_list_option_takes_a_single_string_as_a_one_item_list() -> None:
    options = _list_options()
    assert {"api_key", "served_model_name", "middleware"} <= {a.dest for a in options}
    for action in options:
        if action.dest == "lora_modules":
            continue  # its items are name=path pairs, checked below
        item = next(iter(action.choices)) if action.choices else 1 if _takes_int(action) else "x"
        args = serve_namespace(MODEL, {action.dest: item})
        assert (
            getattr(args, action.dest) == _cli(action.option_strings[0], str(item)).__dict__[action.dest]
        ), action.dest
        assert getattr(args, action.dest) == [item], action.dest


def test_lora_modules_list_is_parsed_as_vllm_serve_does() -> None:
    args = serve_namespace(MODEL, {"lora_modules": ["a=/p/a", "b=/p/b"]})
    assert args.lora_modules == _cli("--lora-modules", "a=/p/a", "b=/p/b").lora_modules


def test_every_flag_takes_true_and_false_as_vllm_serve_does() -> None:
    options = _flag_options()
    assert {"enforce_eager", "enable_prefix_caching"} <= {a.dest for a in options}
    for action in options:
        for value in (True, False):
            args = serve_namespace(MODEL, {action.dest: value})
            assert getattr(args, action.dest) is value, (action.dest, value)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("max_model_len", 2048, 2048),
        ("max_model_len", "2k", 2000),
        ("kv_cache_memory_bytes", 64 << 20, 64 << 20),
        ("gpu_memory_utilization", 1, 1.0),
        ("hf_overrides", {"a": 1}, {"a": 1}),
        ("allowed_origins", ["*"], ["*"]),
    ],
)
def test_values_are_converted_by_vllms_types(key: str, value: Any, expected: Any) -> None:
    assert getattr(serve_namespace({**MODEL, key: value}, {}), key) == expected


@pytest.mark.parametrize(
    ("table", "key", "value", "fix"),
    [
        ("server", "api_key", 42, "a string"),
        ("server", "api_key", True, "a string"),
        ("engine", "enforce_eager", "false", "true or false"),
        ("engine", "max_num_batched_tokens", 1.5, "an integer"),
        ("engine", "gpu_memory_utilization", "high", "a number"),
        ("engine", "block_size", "x", "an integer"),
        ("engine", "served_model_name", [1], "a string"),
    ],
)
def test_wrong_type_is_refused_naming_key_value_and_fix(table: str, key: str, value: Any, fix: str) -> None:
    engine, server = ({key: value}, {}) if table == "engine" else ({}, {key: value})
    errors = engine_table_errors(engine, server)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"[{table}] {key} = {value!r}:"), errors
    assert fix in errors[0], errors


def test_right_types_pass_check() -> None:
    engine = {"max_num_seqs": 8, "enforce_eager": True, "max_model_len": 2048, "served_model_name": ["t"]}
    assert engine_table_errors(engine, {"api_key": "k", "allowed_origins": ["*"]}) == []


# -- engine values within vLLM's own bounds (refused before any restart) ---------------------------


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        (
            "gpu_memory_utilization",
            1.5,
            "CacheConfig.gpu_memory_utilization: Input should be less than or equal to 1",
        ),
        ("gpu_memory_utilization", 0, "CacheConfig.gpu_memory_utilization: Input should be greater than 0"),
        (
            "tensor_parallel_size",
            0,
            "ParallelConfig.tensor_parallel_size: Input should be greater than or equal to 1",
        ),
        ("max_num_batched_tokens", 0, "SchedulerConfig.max_num_batched_tokens"),
    ],
)
def test_engine_value_out_of_vllms_bounds_is_refused(key: str, value: Any, says: str) -> None:
    errors = engine_table_errors({key: value}, {})
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"[engine] {key} = {value!r}: vLLM refuses it ({says}"), errors


def test_engine_values_within_vllms_bounds_pass() -> None:
    engine = {
        "gpu_memory_utilization": 1.0,
        "tensor_parallel_size": 1,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_bytes": "64M",
        "block_size": 16,
        "scheduling_policy": "priority",
        "max_model_len": "2k",
        "dtype": "bfloat16",
    }
    assert engine_table_errors(engine, {}) == []


def test_check_config_refuses_gpu_memory_utilization_above_one(tmp_path: Path) -> None:
    """check-config and reload both load through ``load_config``: a reload keeps the old config."""
    path = write_config(tmp_path / "config.toml", engine={"gpu_memory_utilization": 1.5})
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert [e for e in exc.value.errors if "gpu_memory_utilization" in e] == [
        "[engine] gpu_memory_utilization = 1.5: vLLM refuses it (CacheConfig.gpu_memory_utilization: "
        "Input should be less than or equal to 1); use a value it accepts"
    ]
