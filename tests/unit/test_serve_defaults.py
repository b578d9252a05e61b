"""The daemon resolves the engine arguments ``vllm serve`` resolves for the same command line.

vLLM picks ``max_num_batched_tokens`` and ``max_num_seqs`` by platform and usage context
(``EngineArgs.get_batch_defaults``): ``vllm serve`` builds in the OpenAI-server context, 8192 and 1024
on an H100/H200-class GPU, where the default context takes 2048 and 128. vLLM's own resolution runs
on both sides here: on ``vllm serve``'s namespace for the model alone, and on the daemon's (the
config loaded, then the namespace and engine arguments its engine host builds from), for a GPU
platform stub and for this CPU."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.engine import arg_utils
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser

from controller.bench.servers import to_toml
from controller.config.load import load_config
from controller.control.steps import StepFeed
from controller.engine.runtime import host as host_module
from controller.engine.runtime.args import serve_namespace
from tests.helpers import TINY_MODEL, free_port

GIB = 1 << 30
MAX_MODEL_LEN = 2048


class GpuPlatform:
    """vLLM's ``current_platform`` with one GPU of ``memory``, as ``get_batch_defaults`` asks it; the
    rest from the platform of this host."""

    def __init__(self, host: Any, name: str, memory: int) -> None:
        self.host, self.name, self.memory = host, name, memory

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.host, attr)

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.memory

    def get_device_name(self, device_id: int = 0) -> str:
        return self.name

    def is_cpu(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False


def on_gpu(monkeypatch: pytest.MonkeyPatch, name: str, memory: int) -> None:
    monkeypatch.setattr(
        arg_utils, "current_platform", GpuPlatform(vars(arg_utils)["current_platform"], name, memory)
    )


def resolved(eargs: AsyncEngineArgs, usage: UsageContext | None) -> tuple[int, int]:
    """vLLM's own defaults of the token budget and the batch size for ``eargs`` in ``usage``."""
    model = SimpleNamespace(max_model_len=MAX_MODEL_LEN, is_multimodal_model=False, is_mm_prefix_lm=False)
    eargs._set_default_max_num_seqs_and_batched_tokens_args(
        usage,
        model,  # type: ignore[arg-type]
        SimpleNamespace(use_batched_dp_moe=False),  # type: ignore[arg-type]
    )
    assert eargs.max_num_batched_tokens is not None and eargs.max_num_seqs is not None
    return eargs.max_num_batched_tokens, eargs.max_num_seqs


def vllm_serve(**options: Any) -> tuple[int, int]:
    """``vllm serve MODEL --max-model-len 2048 [options]``, as vLLM's serve command resolves it."""
    argv = ["--model", str(TINY_MODEL), "--max-model-len", str(MAX_MODEL_LEN)]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)  # type: ignore[no-untyped-call]
    return resolved(AsyncEngineArgs.from_cli_args(args), UsageContext.OPENAI_API_SERVER)


class BuildStarted(Exception):
    """Stops an engine build once vLLM was asked for its config (or its engine)."""


def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **engine: Any) -> tuple[int, int]:
    """The daemon on a config with the same [engine]: the engine arguments and the usage context its
    engine host's build hands to vLLM."""
    tables = {
        "engine": {"model": str(TINY_MODEL), "max_model_len": MAX_MODEL_LEN, **engine},
        "server": {"host": "127.0.0.1", "port": free_port()},
        "admin": {"host": "127.0.0.1", "port": free_port()},
    }
    path = tmp_path / "config.toml"
    path.write_text(to_toml(tables))
    config = load_config(path)
    args = serve_namespace(config.engine, {"host": "127.0.0.1", "port": config.server.port})
    asked: list[tuple[AsyncEngineArgs, Any]] = []

    def create_engine_config(self: AsyncEngineArgs, usage_context: Any = None, *more: Any) -> None:
        asked.append((self, usage_context))
        raise BuildStarted

    with monkeypatch.context() as patch:
        patch.setattr(AsyncEngineArgs, "create_engine_config", create_engine_config)
        with pytest.raises(BuildStarted):
            host_module.EngineHost(args, StepFeed())._build(args)
    return resolved(*asked[0])


@pytest.mark.parametrize(
    ("name", "memory", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 80 * GIB, (8192, 1024)),
        ("NVIDIA H200", 141 * GIB, (8192, 1024)),
        ("NVIDIA B200", 180 * GIB, (16384, 1024)),
        ("NVIDIA A100-SXM4-80GB", 80 * GIB, (2048, 256)),
        ("NVIDIA L4", 24 * GIB, (2048, 256)),
    ],
)
def test_on_a_gpu_the_daemon_takes_vllm_serves_batch_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, memory: int, expected: tuple[int, int]
) -> None:
    on_gpu(monkeypatch, name, memory)
    assert vllm_serve() == expected
    assert daemon(tmp_path, monkeypatch) == expected


def test_on_a_gpu_the_options_given_resolve_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 80 * GIB)
    for options in (
        {"tensor_parallel_size": 2},
        {"performance_mode": "throughput"},
        {"max_num_batched_tokens": 512},
    ):
        assert daemon(tmp_path, monkeypatch, **options) == vllm_serve(**options), options


def test_on_this_cpu_the_daemon_takes_vllm_serves_batch_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert daemon(tmp_path, monkeypatch) == vllm_serve() == (2048, 128)


def test_each_engine_build_asks_vllm_for_the_serve_usage_context(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []

    class FakeEngineArgs:
        def create_engine_config(self, usage_context: Any = None) -> Any:
            asked.append(("config", usage_context))
            return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False))

    class FakeAsyncLLM:
        @classmethod
        def from_engine_args(cls, eargs: Any, usage_context: Any = None, **kwargs: Any) -> Any:
            asked.append(("engine", usage_context))
            raise BuildStarted

    monkeypatch.setattr(host_module, "engine_args", lambda args: FakeEngineArgs())
    monkeypatch.setattr(host_module, "AsyncLLM", FakeAsyncLLM)
    engine_host = host_module.EngineHost(argparse.Namespace(max_num_seqs=4), StepFeed())
    with pytest.raises(BuildStarted):
        engine_host._build(argparse.Namespace(max_num_seqs=4))
    serve = UsageContext.OPENAI_API_SERVER
    assert asked == [("config", serve), ("engine", serve)]
