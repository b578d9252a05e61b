"""``bench sweep``'s settings: engine keys build one server each, dotted keys set the daemon's tables."""

from __future__ import annotations

import argparse
import json
import threading
import tomllib
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from controller.bench import servers
from controller.bench.experiments.sweep import parse_sets, server_specs, settings
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
    sets = parse_sets(["control.params.max_num_active_seqs=1,8", "server.engine_poll_sleep_s=0.0002"])
    specs = server_specs(bench(max_queue=5), settings(sets), "daemon")
    assert {s.name for s in specs} == {
        "control.params.max_num_active_seqs=1,server.engine_poll_sleep_s=0.0002",
        "control.params.max_num_active_seqs=8,server.engine_poll_sleep_s=0.0002",
    }
    assert all(s.engine == {"model": "/m", "max_num_seqs": 64} for s in specs)
    assert [s.control for s in specs] == [
        {"policy": "static", "params": {"max_num_active_seqs": 1}},
        {"policy": "static", "params": {"max_num_active_seqs": 8}},
    ]
    assert specs[0].admission == {"limit": 8, "max_queue": 5}
    assert specs[0].server == {"engine_poll_sleep_s": 0.0002}


def test_daemon_settings_are_refused_for_vllm_serve_and_outside_the_daemon_tables() -> None:
    with pytest.raises(ValueError, match="a daemon setting; sweep it with --server daemon"):
        server_specs(bench(), settings(parse_sets(["admission.limit=4"])), "vllm-serve")
    with pytest.raises(ValueError, match=r"sweep keys of \[control\], \[admission\] or \[server\]"):
        server_specs(bench(), settings(parse_sets(["admin.port=4"])), "daemon")


class _Daemon(BaseHTTPRequestHandler):
    """/reload answers ok; /state shows the batch cap stepping down twice, then holding."""

    caps: ClassVar[list[int]] = []
    reloads: ClassVar[int] = 0

    def do_POST(self) -> None:
        type(self).reloads += 1
        self._answer({"ok": True})

    def do_GET(self) -> None:
        cap = self.caps.pop(0) if len(self.caps) > 1 else self.caps[0]
        self._answer({"admission_limit": 64, "batch_cap": cap, "token_budget": None})

    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_reconfigure_rewrites_the_config_reloads_and_waits_for_the_knobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "SETTLE_S", 1.0)
    _Daemon.caps, _Daemon.reloads = [64, 32, 16, 16], 0
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Daemon)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    port = http.server_address[1]
    b = bench()
    first, second = server_specs(
        b, settings(parse_sets(["control.params.max_num_active_seqs=64,16"])), "daemon"
    )
    config = tmp_path / "daemon.toml"
    url = f"http://127.0.0.1:{port}"
    server = servers.Launched(first, url, f"{url}/metrics", f"{url}/state", 1, 0.0, tmp_path / "log",
                              config_path=config)  # fmt: skip
    try:
        servers.reconfigure(server, second, b.base)
    finally:
        http.shutdown()
    assert _Daemon.reloads == 1 and _Daemon.caps == [16] and server.spec is second
    written = tomllib.loads(config.read_text())
    assert written["control"]["params"] == {"max_num_active_seqs": 16}
    assert written["server"]["port"] == port and written["admin"]["port"] == port
    with pytest.raises(ValueError, match="differs from"):
        servers.reconfigure(server, replace(second, engine={"model": "/other"}), b.base)
