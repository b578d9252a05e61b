"""Profiles (TOML, shipped as package data), the calibration fit, and the ``simulate`` command."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from controller.bench.calibrate.fit import Sample, fit, nnls
from controller.cli import main
from controller.profiles.load import (
    ProfileError,
    available_profiles,
    dump_profile,
    load_profile,
    parse_profile,
)
from controller.sim.cli import parse_params
from policies.cost import StepCoefficients

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_shipped_profiles_load_and_cite_their_sources() -> None:
    assert {"cpu-tiny", "h200-8b"} <= set(available_profiles())
    h200 = load_profile("h200-8b")
    assert h200.engine.kv_cache_tokens * 128 * 1024 < 141e9  # 128 KiB per token fits the GPU
    assert any(s.startswith("https://") for s in h200.sources)
    cpu = load_profile("cpu-tiny")
    assert cpu.fit["r2"] > 0 and cpu.cost.a_s > 0
    # the two SmolLM2 fits belong to two CPUs: AVX-512 prefills about 5x faster than AVX2
    avx2, avx512 = load_profile("cpu-smollm2"), load_profile("cpu-smollm2-avx512")
    assert "AVX2" in avx2.hardware and "AVX-512" in avx512.hardware
    assert avx512.cost.b_s_per_prefill_token * 4 < avx2.cost.b_s_per_prefill_token
    assert avx512.fit["r2"] > 0.99 and len(avx512.variance.as_dict()) == 3  # all three tables
    # and AMX (Sapphire Rapids) in bf16 about 4x faster again, with this box's own variance tables
    amx = load_profile("cpu-smollm2-amx")
    assert "AMX" in amx.hardware and "bfloat16" in amx.model
    assert amx.cost.b_s_per_prefill_token * 4 < avx512.cost.b_s_per_prefill_token
    assert amx.engine.kv_cache_tokens == 11648  # 256 MiB of bf16 KV, as config.toml's engine has
    assert amx.fit["r2"] > 0.95 and len(amx.variance.as_dict()) == 3


def test_profile_errors_name_the_problem() -> None:
    with pytest.raises(ProfileError, match=r"unknown profile 'h100'.*cpu-tiny"):
        load_profile("h100")
    with pytest.raises(ProfileError, match=r"\[cost\] a_s = -1"):
        parse_profile(
            "[cost]\na_s = -1\nb_s_per_prefill_token = 0\nc_s_per_decode_seq = 0\nd_s_per_kv_token = 0", "x"
        )
    text = dump_profile(load_profile("h200-8b")).replace("kv_cache_tokens = 876544", "kv_cache_tokens = 1000")
    with pytest.raises(ProfileError, match="holds less than one request of max_model_len"):
        parse_profile(text, "x")


def test_dump_and_parse_round_trip(tmp_path: Path) -> None:
    p = load_profile("h200-8b")
    path = tmp_path / "copy.toml"
    path.write_text(dump_profile(p))
    again = load_profile(path)
    assert (again.cost, again.engine, again.sources) == (p.cost, p.engine, p.sources)


def test_the_fit_recovers_known_coefficients_from_noisy_samples() -> None:
    true = StepCoefficients(
        a_s=0.004, b_s_per_prefill_token=1e-5, c_s_per_decode_seq=9e-5, d_s_per_kv_token=5e-8
    )
    rng = random.Random(0)
    samples = []
    for n in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (50, 560):
            step = true.step_s(0, n, n * ctx) * rng.gauss(1, 0.02)
            samples.append(Sample("decode", 1, 0, n, n * ctx, step))
    for p in (32, 256, 1024, 1536):
        samples.append(Sample("prefill", 1, p, 0, p, true.step_s(p, 0, p) + 0.008))
    cost, http_s, r2 = fit(samples)
    assert cost.a_s == pytest.approx(true.a_s, rel=0.1)
    assert cost.c_s_per_decode_seq == pytest.approx(true.c_s_per_decode_seq, rel=0.1)
    assert cost.b_s_per_prefill_token == pytest.approx(true.b_s_per_prefill_token, rel=0.25)
    assert http_s == pytest.approx(0.008, rel=0.2)
    assert r2 > 0.99


def test_nnls_keeps_every_coefficient_non_negative() -> None:
    import numpy as np

    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # a negative slope: fixed at 0, the intercept takes the mean
    assert nnls(x, y).tolist() == pytest.approx([2.0, 0.0])


def test_params_are_toml_values_or_strings() -> None:
    assert parse_params(["setpoint=0.8", "kv_source=max", "preset=\"mixed\"", "x=true"]) == {
        "setpoint": 0.8, "kv_source": "max", "preset": "mixed", "x": True,
    }  # fmt: skip
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_params(["oops"])


def test_simulate_writes_what_bench_run_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code = main([
        "simulate", "--trace", str(TRACES / "azure_llm_2023_code.csv"), "--duration", "60",
        "--time-scale", "2", "--profile", "h200-8b", "--policy", "hysteresis", "--param", "low=0.6",
        "--slo-ttft", "1.0", "--slo-tpot", "0.05", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    assert "hysteresis:" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "sim" and summary["policy"] == "hysteresis"
    assert summary["policy_params"]["low"] == 0.6
    assert summary["ok"] == summary["requests"] > 50
    from controller.results.records import read_records, read_series

    assert len(read_records(out / "records.jsonl")) == summary["requests"]
    assert read_series(out / "timeseries.jsonl")[0].batch_cap == 1024
    assert (out / "report" / "report.md").is_file()


def test_simulate_refuses_bad_input_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", "--trace", str(tmp_path / "none.csv"), "--profile", "h200-8b", "--slo-ttft", "1",
            "--slo-tpot", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 1
    assert "no such file" in capsys.readouterr().err
    assert main([*args[:4], "nope", *args[5:]]) == 1
    assert "unknown profile 'nope'" in capsys.readouterr().err
