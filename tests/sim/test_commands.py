"""The twin's commands that replaced the bench scripts: ``simulate --compare`` (was
``bench/sim_compare.py``), ``bench validate`` (was ``bench/validate_sim.py``) and ``bench calibrate
--config`` (was ``bench/calibrate_cpu.sh``). Only what runs without an engine is tested here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.bench.calibrate.validate import RATIO_KEYS
from controller.cli import main
from controller.sim.compare import CONFIGS

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_simulate_compare_runs_every_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "code"
    code = main([
        "simulate", "--compare", "--trace", str(TRACES / "azure_llm_2023_code.csv"), "--duration", "30",
        "--time-scale", "2", "--profile", "h200-8b", "--slo-ttft", "1.0", "--slo-tpot", "0.05",
        "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    assert "| config | goodput req/s |" in capsys.readouterr().out
    data = json.loads((out / "compare.json").read_text())
    assert [r["config"] for r in data["runs"]] == [name for name, _, _ in CONFIGS]
    assert data["meta"]["profile"] == "h200-8b" and data["meta"]["time_scale"] == 2.0
    pid = json.loads((out / "pid" / "summary.json").read_text())
    assert pid["policy"] == "pid" and pid["target"] == "twin:h200-8b:pid"
    assert (out / "pid" / "records.jsonl").is_file() and (out / "pid" / "decisions.jsonl").is_file()
    assert (out / "goodput.png").is_file() and (out / "series.png").is_file()
    assert (out / "compare.md").read_text().count("\n") == len(CONFIGS) + 2


def test_validate_from_real_figures_reruns_only_the_twin(tmp_path: Path) -> None:
    real = {"requests": 10, "ok": 10, "throughput_tok_s": 100.0, "ttft_p50": 0.02, "ttft_p99": 0.05,
            "tpot_p50": 0.004, "duration_s": 20.0}  # fmt: skip
    previous = tmp_path / "before.json"
    previous.write_text(json.dumps([{"time_scale": 4.0, "real": real}]))
    out = tmp_path / "v"
    code = main([
        "bench", "validate", "--trace", str(TRACES / "azure_llm_2023_conv.csv"), "--duration", "20",
        "--time-scale", "4", "--real-from", str(previous), "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    (row,) = json.loads((out / "validation.json").read_text())
    assert row["real"] == real
    assert len(row["twin_p99_over_seeds"]) == 5
    for key in RATIO_KEYS:
        assert row["twin_over_real"][key] == pytest.approx(row["twin"][key] / real[key])
    assert row["twin_mean_model"]["requests"] == row["twin"]["requests"] > 0


def test_validate_takes_the_median_of_every_real_run_it_is_given(tmp_path: Path) -> None:
    """An older file holds one ``real``, a newer one ``real_runs``: the three are pooled, and each
    figure is their median (so one slow run does not move the figure the twin is held to)."""

    def fig(ttft_p50: float, tok_s: float) -> dict[str, float]:
        return {"requests": 10, "ok": 10, "throughput_tok_s": tok_s, "ttft_p50": ttft_p50,
                "ttft_p99": 3 * ttft_p50, "tpot_p50": 0.004, "duration_s": 20.0}  # fmt: skip

    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps([{"time_scale": 4.0, "real": fig(0.171, 2.4)}]))
    runs = [fig(0.225, 2.5), fig(0.190, 2.3)]
    new.write_text(json.dumps([{"time_scale": 4.0, "real": runs[0], "real_runs": runs}]))
    out = tmp_path / "v"
    code = main([
        "bench", "validate", "--trace", str(TRACES / "azure_llm_2023_conv.csv"), "--duration", "20",
        "--time-scale", "4", "--real-from", str(old), str(new), "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    (row,) = json.loads((out / "validation.json").read_text())
    assert [r["ttft_p50"] for r in row["real_runs"]] == [0.171, 0.225, 0.190]
    assert row["real"] == fig(0.190, 2.4) | {"ttft_p99": pytest.approx(0.570)}
    assert row["twin_over_real"]["ttft_p50"] == pytest.approx(row["twin"]["ttft_p50"] / 0.190)


def test_calibrate_needs_a_server_or_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "calibrate", "--out", str(tmp_path / "p.toml")]) == 2
    assert "give --url URL" in capsys.readouterr().err
    out = str(tmp_path / "p.toml")
    args = ["bench", "calibrate", "--url", "http://x", "--config", "c.toml", "--out", out]
    assert main(args) == 2
