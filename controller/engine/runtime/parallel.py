"""[engine] parallelism (tensor, pipeline, data parallel; the executor backend) checked with vLLM's own
``ParallelConfig`` at config load.

``args.py`` checks each engine value alone against its field's type and bounds
(``tensor_parallel_size = 0``). The parallel settings also constrain one another
(``data_parallel_size_local`` <= ``data_parallel_size``, a world size the node's GPUs hold) and name an
executor that must be importable (Ray). vLLM only finds those at the engine build, after the old engine
has drained; building ``ParallelConfig`` alone finds them at ``check-config`` and reload, with vLLM's own
words. It loads no model: the checks that need the model's shape (attention heads divisible by the
tensor parallel size) stay with vLLM's engine build, which the guard's build-before-swap survives.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, get_args

from controller.control.samplers import EngineDevices

_SPMD_ONLY = (
    "'external_launcher' runs one engine per torchrun process for offline SPMD inference, not a server; "
    "use 'mp' (one node) or 'ray' (one or more nodes)"
)


@functools.cache
def parallel_keys() -> frozenset[str]:
    """Engine arguments that are ``ParallelConfig`` fields (the same names in both)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    ours = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return frozenset(f.name for f in dataclasses.fields(ParallelConfig) if f.name in ours)


def _message(exc: Exception) -> str:
    """vLLM's words: pydantic wraps a validator's ValueError as 'Value error, <vLLM's message>'."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(map(str, first.get("loc", ())))
        msg = str(first["msg"]).removeprefix("Value error, ")
        return f"{where}: {msg}" if where else msg
    return str(exc).strip()


def _backend_error(name: str) -> str | None:
    """A backend vLLM's executor lookup (``Executor.get_class``) would refuse, or Ray when it is not
    installed (vLLM's own ``assert_ray_available``)."""
    from vllm.config.parallel import DistributedExecutorBackend
    from vllm.v1.executor import ray_utils
    from vllm.v1.executor.abstract import Executor

    known = get_args(DistributedExecutorBackend)
    try:
        if name == "ray":
            ray_utils.assert_ray_available()
        elif name not in known and "." not in name:
            return f"'{name}' is not one of {', '.join(known[:3])} nor a 'module.Class' Executor"
        elif name not in known:  # a plug-in executor, named as vLLM resolves it
            config = types.SimpleNamespace(
                parallel_config=types.SimpleNamespace(distributed_executor_backend=name)
            )
            Executor.get_class(config)
    except (ImportError, ValueError, TypeError, AttributeError) as exc:
        return f"{_message(exc).rstrip('.')}; install what it names or use 'mp'"
    return None


def parallel_errors(engine: dict[str, Any]) -> list[str]:
    """vLLM's refusal of the [engine] parallel settings taken together, as config errors with a fix.

    ``engine`` holds values as vLLM's parser made them; call it only when each value passed alone.
    """
    from vllm.config import ParallelConfig

    given = {k: v for k, v in engine.items() if k in parallel_keys() and v is not None}
    shown = ", ".join(f"{k} = {v!r}" for k, v in sorted(given.items()))
    if given.get("distributed_executor_backend") == "external_launcher":
        return [f"[engine] {shown}: {_SPMD_ONLY}"]
    backends = {given.get("distributed_executor_backend"), given.get("data_parallel_backend")}
    problems = [p for b in sorted(b for b in backends if isinstance(b, str)) if (p := _backend_error(b))]
    if problems or not given:
        return [f"[engine] {shown}: {p}" for p in problems]
    try:
        ParallelConfig(**given)
    except (ValueError, TypeError) as exc:
        return [f"[engine] {shown}: vLLM's ParallelConfig refuses them ({_message(exc)}); change them"]
    return []


def engine_devices(args: Any) -> EngineDevices:
    """The GPUs of this host the engine built from ``args`` (vLLM's serve namespace) runs on, as vLLM
    assigns its local ranks (``vllm/v1/engine/utils.get_physical_gpu_ids_for_local_dp_rank``): one
    per rank of tensor x pipeline x prefill-context parallelism, for each data-parallel rank on this
    node (``data_parallel_size_local``; else all of ``data_parallel_size``, one for an external rank),
    from ``--device-ids`` where given (the Ray executor ignores them), else from the visible devices."""

    def size(name: str) -> int:
        value = getattr(args, name, None)
        return int(value) if value else 1

    world = size("tensor_parallel_size") * size("pipeline_parallel_size")
    world *= size("prefill_context_parallel_size")
    local = getattr(args, "data_parallel_size_local", None)
    external = getattr(args, "data_parallel_rank", None) is not None or getattr(
        args, "data_parallel_external_lb", False
    )
    if external:
        local = 1
    elif local is None:  # over nodes, each holds its share of the ranks
        local = max(size("data_parallel_size") // size("nnodes"), 1)
    ids = getattr(args, "device_ids", None)
    if getattr(args, "distributed_executor_backend", None) == "ray":
        ids = None
    return EngineDevices(world * max(int(local), 1), tuple(str(i) for i in ids) if ids else None)
