"""The memory guard's floor holds one max_model_len sequence: a config whose
``[guard] min_kv_cache_memory_bytes`` is below it is refused at load, naming the key, the value, the
least the model needs and the fix (vLLM would refuse every memory restart down to it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.config.load import ConfigError, load_config
from tests.helpers import write_config

SMOLLM2 = {  # SmolLM2-135M's attention: 23,040 KV bytes a token in bf16
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
}
NEED_2048 = 2 * 30 * 3 * 64 * 2 * 2048


def model_folder(tmp_path: Path, **overrides: Any) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**SMOLLM2, **overrides}))
    return folder


def config_with(tmp_path: Path, model: Path, floor: int, **engine: Any) -> Path:
    return write_config(
        tmp_path / "config.toml",
        engine={"model": str(model), "max_model_len": 2048, **engine},
        guard={"min_kv_cache_memory_bytes": floor},
    )


def test_a_floor_below_one_max_model_len_sequence_is_refused_at_load_naming_key_value_and_need(
    tmp_path: Path,
) -> None:
    path = config_with(tmp_path, model_folder(tmp_path), 16 << 20)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (error,) = [e for e in info.value.errors if "min_kv_cache_memory_bytes" in e]
    assert error.startswith(f"[guard] min_kv_cache_memory_bytes = {16 << 20}:")
    assert f"at least {NEED_2048}" in error and "max_model_len" in error


def test_a_floor_that_holds_one_sequence_loads(tmp_path: Path) -> None:
    assert load_config(config_with(tmp_path, model_folder(tmp_path), NEED_2048)).guard


def test_a_float32_model_needs_twice_the_bytes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(config_with(tmp_path, model_folder(tmp_path), NEED_2048, dtype="float32"))


def test_a_sliding_window_model_is_not_held_to_a_full_sequence(tmp_path: Path) -> None:
    """Its window layers hold less than max_model_len tokens: the full-attention bound would refuse a
    floor that builds."""
    assert load_config(config_with(tmp_path, model_folder(tmp_path, sliding_window=512), 16 << 20)).guard


def test_the_shipped_config_holds_its_models_sequence() -> None:
    assert load_config(Path(__file__).parents[2] / "config.toml").guard.min_kv_cache_memory_bytes >= NEED_2048


def test_without_a_guard_floor_set_the_default_is_raised_to_one_sequence(tmp_path: Path) -> None:
    """`vllm-autopilot serve MODEL --kv-cache-memory-bytes N` has no [guard] table: the default
    16 MiB floor, below SmolLM2's 45 MiB sequence, refused the drop-in at start. Only a floor the
    operator set is an error; the default is raised to what vLLM can build."""
    path = write_config(
        tmp_path / "config.toml", engine={"model": str(model_folder(tmp_path)), "max_model_len": 2048}
    )
    assert load_config(path).guard.min_kv_cache_memory_bytes == NEED_2048
