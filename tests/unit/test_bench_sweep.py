"""``bench sweep``'s settings: engine keys build one server each, dotted keys set the daemon's tables."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from controller.bench.sweep import parse_sets, server_specs, settings
from controller.bench.targets import Bench


def bench(**admission: Any) -> Bench:
    base = {"engine": {"model": "/m", "max_num_seqs": 64}, "admission": {"limit": 8, **admission}}
    return Bench(base, [], None, argparse.Namespace())  # type: ignore[arg-type]


def test_an_engine_setting_changes_the_engine_and_the_gate_follows_max_num_seqs() -> None:
    specs = server_specs(bench(), settings(parse_sets(["max_num_seqs=4,16"])), "daemon")
    assert [s.engine["max_num_seqs"] for s in specs] == [4, 16]
    assert [s.admission["limit"] for s in specs] == [4, 16]
    assert specs[0].control == {"policy": "static", "params": {}}


def test_a_dotted_key_sets_the_daemon_and_keeps_the_engine() -> None:
    sets = parse_sets(["control.params.batch_cap=1,8", "server.engine_poll_sleep_s=0.0002"])
    specs = server_specs(bench(max_queue=5), settings(sets), "daemon")
    assert {s.name for s in specs} == {
        "control.params.batch_cap=1,server.engine_poll_sleep_s=0.0002",
        "control.params.batch_cap=8,server.engine_poll_sleep_s=0.0002",
    }
    assert all(s.engine == {"model": "/m", "max_num_seqs": 64} for s in specs)
    assert [s.control for s in specs] == [
        {"policy": "static", "params": {"batch_cap": 1}},
        {"policy": "static", "params": {"batch_cap": 8}},
    ]
    assert specs[0].admission == {"limit": 8, "max_queue": 5}
    assert specs[0].server == {"engine_poll_sleep_s": 0.0002}


def test_daemon_settings_are_refused_for_vllm_serve_and_outside_the_daemon_tables() -> None:
    with pytest.raises(ValueError, match="a daemon setting; sweep it with --server daemon"):
        server_specs(bench(), settings(parse_sets(["admission.limit=4"])), "vllm-serve")
    with pytest.raises(ValueError, match=r"sweep keys of \[control\], \[admission\] or \[server\]"):
        server_specs(bench(), settings(parse_sets(["admin.port=4"])), "daemon")
