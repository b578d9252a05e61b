"""Warm-up calibration: a short, bounded run of synthetic requests through the real engine before the
daemon reports ready, so the step-cost model starts from this box and this model rather than from a
profile fitted elsewhere (TGI sizes itself the same way at its warm-up).

The requests are random token ids (never a prefix the cache holds), sent straight to the AsyncLLM
(no gate: nothing serves yet), with ``ignore_eos`` so each runs exactly its planned tokens. The
phases excite each term of ``step = a + b*prefill + c*decode_seqs + d*kv_tokens`` apart: a prompt
alone (``b``), batches of short streams (``c``), and a few streams over long prompts (``d``). They run
in order of what they teach, and a phase starts only while the time budget lasts, so a slow box
(SmolLM2 on a 2-core AVX2 CPU prefills at ~7 ms a token) does fewer phases rather than more seconds.
The steps themselves are measured inside the EngineCore (``scheduler.py``) and drained by the host.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from controller.control.warmfit import WarmupPhase
from controller.engine.runtime.dtype import cpuinfo_text

log = structlog.get_logger(__name__)

REQUEST_PREFIX = "autopilot-warmup-"
"""The warm-up's request ids start so: the outcome count leaves them out (``stats.py``)."""


@dataclass(frozen=True)
class WarmupRun:
    """What a warm-up ran: its phases, how many requests, how long it took."""

    phases: tuple[str, ...]
    requests: int
    seconds: float
    skipped: tuple[str, ...]
    """Phases not started: the time budget was spent."""


async def run(
    llm: Any,
    phases: list[WarmupPhase],
    budget_s: float,
    vocab_size: int,
    clock: Callable[[], float] = time.monotonic,
    seed: int = 0,
) -> WarmupRun:
    """Run ``phases`` in order through ``llm`` while ``budget_s`` lasts (a phase that started
    finishes; one running past twice the budget is aborted)."""
    rng = random.Random(seed)
    ids = itertools.count()
    start = clock()
    done: list[str] = []
    requests = 0
    for k, phase in enumerate(phases):
        if clock() - start >= budget_s:
            skipped = tuple(p.describe() for p in phases[k:])
            return WarmupRun(tuple(done), requests, clock() - start, skipped)
        names = [f"{REQUEST_PREFIX}{next(ids)}" for _ in range(phase.streams)]
        params = SamplingParams(max_tokens=phase.output_tokens, ignore_eos=True, temperature=0.0)
        prompts = [
            TokensPrompt(prompt_token_ids=[rng.randrange(1, vocab_size) for _ in range(phase.prompt_tokens)])
            for _ in names
        ]
        left = max(1.0, 2 * budget_s - (clock() - start))
        try:
            async with asyncio.timeout(left):
                await asyncio.gather(
                    *(_drain(llm.generate(p, params, n)) for p, n in zip(prompts, names, strict=True))
                )
        except TimeoutError:
            await llm.abort(names)
            log.warning("warmup_phase_aborted", phase=phase.describe(), after_s=round(clock() - start, 1))
            return WarmupRun(tuple(done), requests, clock() - start, tuple(p.describe() for p in phases[k:]))
        requests += phase.streams
        done.append(phase.describe())
    return WarmupRun(tuple(done), requests, clock() - start, ())


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def vocab_size(llm: Any) -> int:
    """The served model's vocabulary (random prompts stay within it)."""
    return int(llm.model_config.get_vocab_size())


def cost_key(llm: Any, cpu_flags: str | None = None) -> dict[str, Any]:
    """What a step's cost depends on: the model, its dtype and quantization, the engine arguments
    that change a step's work, the hardware and vLLM's version. A fit stored under one key is
    reused only by an engine with the same one."""
    import vllm

    cfg = llm.vllm_config
    m, c, p = cfg.model_config, cfg.cache_config, cfg.parallel_config
    return {
        "model": str(m.model),
        "dtype": str(m.dtype),
        "quantization": str(getattr(m, "quantization", None)),
        "enforce_eager": bool(getattr(m, "enforce_eager", False)),
        "block_size": getattr(c, "block_size", None),
        "kv_cache_dtype": str(getattr(c, "cache_dtype", None)),
        "tensor_parallel_size": getattr(p, "tensor_parallel_size", 1),
        "pipeline_parallel_size": getattr(p, "pipeline_parallel_size", 1),
        "device": str(getattr(cfg.device_config, "device_type", "")),
        "hardware": hardware(cpu_flags),
        "vllm": vllm.__version__,
    }


def hardware(cpu_flags: str | None = None) -> str:
    """The machine as far as a step's speed goes: the CPU's model and its flags' digest, and the
    GPUs' names where torch sees any."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    flags = cpu_flags if cpu_flags is not None else (cpuinfo_text() or "")
    model = next(
        (ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")), ""
    )
    digest = hashlib.sha256(
        " ".join(
            sorted({w for ln in flags.splitlines() if ln.startswith("flags") for w in ln.split()})
        ).encode()
    ).hexdigest()[:12]
    return json.dumps({"machine": platform.machine(), "cpu": model, "cpu_flags": digest, "gpus": gpus})
