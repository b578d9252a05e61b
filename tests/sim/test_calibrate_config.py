"""``bench calibrate --config``: the profile records the engine limits of the daemon it started."""

from __future__ import annotations

from pathlib import Path

from controller.bench.calibrate.measure import config_limits


def test_a_config_daemons_limits_are_recorded_and_a_flag_wins(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[engine]\nmodel = "m"\nmax_num_seqs = 64\nscheduling_policy = "priority"\n')
    flags = {
        "max_num_seqs": None,
        "max_num_batched_tokens": None,
        "scheduling_policy": None,
        "kv_cache_tokens": None,
    }
    # before: the flags' defaults (max_num_seqs 256, fcfs) were recorded for a daemon running 64, priority
    assert config_limits(config, flags) == {"max_num_seqs": 64, "scheduling_policy": "priority"}
    assert config_limits(config, {**flags, "max_num_seqs": 32, "kv_cache_tokens": 11648}) == {
        "max_num_seqs": 32,
        "scheduling_policy": "priority",
        "kv_cache_tokens": 11648,
    }
