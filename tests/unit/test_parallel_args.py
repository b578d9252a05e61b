"""[engine] parallelism passes through to vLLM and is checked with vLLM's ParallelConfig at load.

Each value alone is checked against its field (``tensor_parallel_size = 0``); together they are built
into vLLM's ``ParallelConfig`` (``data_parallel_size_local`` above ``data_parallel_size``), and an
executor backend must be one vLLM resolves, Ray installed when it is named.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from controller.config.load import ConfigError, load_config
from controller.engine.runtime.args import engine_args, engine_table_errors, serve_namespace
from tests.helpers import write_config

MODEL = {"model": "/models/tiny"}
HAS_RAY = importlib.util.find_spec("ray") is not None


def _errors(**engine: Any) -> list[str]:
    return engine_table_errors({**MODEL, **engine}, {})


def test_parallel_settings_pass_through_to_vllms_engine_args() -> None:
    engine = {
        **MODEL,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "data_parallel_size": 2,
        "distributed_executor_backend": "mp",
    }
    assert engine_table_errors(engine, {}) == []
    eargs = engine_args(serve_namespace(engine, {}))
    assert (eargs.tensor_parallel_size, eargs.pipeline_parallel_size, eargs.data_parallel_size) == (2, 2, 2)
    assert eargs.distributed_executor_backend == "mp"


def test_tensor_parallel_size_zero_is_refused_by_vllms_bounds() -> None:
    (error,) = _errors(tensor_parallel_size=0)
    assert error.startswith("[engine] tensor_parallel_size = 0: vLLM refuses it")
    assert "ParallelConfig.tensor_parallel_size" in error and "greater than or equal to 1" in error


def test_settings_that_conflict_are_refused_by_parallel_config() -> None:
    (error,) = _errors(data_parallel_size=2, data_parallel_size_local=3)
    assert "data_parallel_size = 2, data_parallel_size_local = 3" in error
    assert "vLLM's ParallelConfig refuses them" in error
    assert "data_parallel_size_local (3) must be <= data_parallel_size (2)" in error


def test_an_unknown_backend_is_refused_with_the_names_vllm_takes() -> None:
    (error,) = _errors(distributed_executor_backend="threads")
    assert "'threads' is not one of ray, mp, uni" in error


def test_a_plugin_backend_must_be_an_executor() -> None:
    (error,) = _errors(distributed_executor_backend="controller.clock.FakeClock")
    assert "must be a subclass of Executor" in error


def test_external_launcher_is_refused_for_a_server() -> None:
    (error,) = _errors(distributed_executor_backend="external_launcher")
    assert "not a server" in error and "use 'mp'" in error


@pytest.mark.skipif(HAS_RAY, reason="Ray is installed here")
@pytest.mark.parametrize("key", ["distributed_executor_backend", "data_parallel_backend"])
def test_ray_is_refused_when_it_is_not_installed(key: str) -> None:
    (error,) = _errors(**{key: "ray"}, tensor_parallel_size=2)
    assert f"{key} = 'ray'" in error and "Failed to import Ray" in error and "pip install ray" in error


@pytest.mark.skipif(not HAS_RAY, reason="Ray is not installed here")
def test_ray_is_accepted_when_it_is_installed() -> None:
    assert _errors(distributed_executor_backend="ray", tensor_parallel_size=2) == []


def test_check_config_refuses_parallel_settings_naming_key_and_value(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.toml", engine={"tensor_parallel_size": 0})
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "[engine] tensor_parallel_size = 0" in str(exc.value)


def test_no_parallel_settings_add_no_error() -> None:
    assert _errors() == []
