"""Where the step-cost model starts (lifecycle/warm.py) and the warm-up's plan
(engine/runtime/warmup.py): exact phases, the fit of a known step cost, the state file's key."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from controller.control.steps import EngineStep
from controller.control.warmfit import WarmupPhase, fit_steps, plan
from controller.engine.runtime.warmup import hardware
from controller.lifecycle.warm import WarmStart, read_state, state_dir, state_path, write_state
from policies.cost import StepCoefficients


def test_the_plan_excites_each_term_within_the_engine_limits() -> None:
    assert plan(64, 2048, 2048) == [
        WarmupPhase(1, 64, 1),
        WarmupPhase(1, 16, 16),
        WarmupPhase(1, 256, 1),  # prefill alone, one decode
        WarmupPhase(2, 64, 16),
        WarmupPhase(4, 64, 16),  # the batches a light load decodes, over chat-sized prompts
        WarmupPhase(8, 16, 16),
        WarmupPhase(16, 16, 16),
        WarmupPhase(32, 16, 16),
        WarmupPhase(64, 16, 8),  # larger batches up to the ceiling, the largest for fewer steps
        WarmupPhase(1, 1024, 1),
        WarmupPhase(4, 512, 16),  # a long prefill, decodes over a long KV
    ]
    small = plan(4, 128, 300)
    assert [p.streams for p in small] == [1, 1, 1, 2, 4, 1, 4]  # no batch past the ceiling
    assert max(p.prompt_tokens for p in small) == 128  # the per-step token ceiling
    assert all(p.prompt_tokens + p.output_tokens <= 300 for p in small)


def steps_of(a: float, b: float, c: float, d: float, noise: float = 0.03) -> list[EngineStep]:
    rng = random.Random(1)
    shapes = [(64, 0, 0), (256, 0, 0), (1024, 0, 0)]
    shapes += [(0, n, n * (16 + i)) for n in (1, 8, 32) for i in range(15)]
    shapes += [(0, 4, 4 * (512 + i)) for i in range(15)]
    return [
        EngineStep.measured(float(t), p, n, k, (a + b * p + c * n + d * k) * (1 + rng.gauss(0, noise)))
        for t, (p, n, k) in enumerate(shapes)
    ]


def test_the_fit_recovers_a_known_step_cost() -> None:
    """SmolLM2 on a 2-core AVX-512 CPU: a 27.4 ms, b 1.22 ms a token, c 1.43 ms a sequence, d 2.3 us."""
    truth = (0.0274, 0.00122, 0.00143, 2.3e-6)
    coefficients, error = fit_steps(steps_of(*truth))
    assert coefficients.vector() == pytest.approx(truth, rel=0.15)
    assert error is not None and error < 0.05


def test_a_state_file_is_read_back_only_under_its_own_key(tmp_path: Path) -> None:
    key = {"model": "m", "dtype": "torch.bfloat16", "hardware": hardware("model name : X\nflags : a b\n")}
    path = state_path(key, tmp_path)
    warm = WarmStart(
        "warm-up",
        "phases 1x64+1",
        {"a_s": 0.02, "b_s_per_prefill_token": 0.001, "c_s_per_decode_seq": 0.002, "d_s_per_kv_token": 1e-6},
    )
    write_state(path, key, warm)
    assert read_state(path, key) == StepCoefficients(0.02, 0.001, 0.002, 1e-6)
    assert read_state(path, {**key, "dtype": "torch.float32"}) is None  # another engine's fit
    assert state_path({**key, "dtype": "torch.float32"}, tmp_path) != path
    path.write_text("{not json")
    assert read_state(path, key) is None


def test_the_state_directory_is_systemds_else_the_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/vllm-autopilot:/other")
    assert state_dir() == Path("/var/lib/vllm-autopilot")
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/cache")
    assert state_dir() == Path("/tmp/cache/vllm-autopilot")


def test_the_hardware_key_changes_with_the_cpu_flags() -> None:
    one = hardware("model name : EPYC\nflags : avx2 avx512f\n")
    assert one == hardware("model name : EPYC\nflags : avx512f avx2\n")
    assert one != hardware("model name : EPYC\nflags : avx2\n")
