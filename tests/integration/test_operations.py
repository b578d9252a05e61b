"""The real daemon as a subprocess, driven by signals as systemd drives it: SIGHUP applies a new
admission limit under load without failing a request, a broken file keeps the old config, and
SIGTERM under load lets in-flight requests finish and exits 0 within the deadline."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import daemon_process, http_session, stream_completion, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


class Proc:
    def __init__(self, path: Path, server_port: int, admin_port: int, popen: subprocess.Popen[bytes]) -> None:
        self.path, self.popen = path, popen
        self.base = f"http://127.0.0.1:{server_port}"
        self.admin = f"http://127.0.0.1:{admin_port}"


def _config(path: Path, ports: tuple[int, int], limit: int, extra: str = "", **engine: Any) -> None:
    write_config(
        path,
        engine=engine,
        server={"port": ports[0], "shutdown_timeout_s": 30.0},
        admin={"port": ports[1]},
        admission={"limit": limit, "max_queue": 256},
        control={"tick_s": 0.5, "policy": "static"},
    )
    if extra:
        path.write_text(path.read_text() + extra)


@pytest.fixture(scope="module")
def daemon_proc(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Proc]:
    from tests.helpers import free_port

    path = tmp_path_factory.mktemp("ops") / "config.toml"
    ports = (free_port(), free_port())
    _config(path, ports, limit=4)
    with daemon_process(path, f"http://127.0.0.1:{ports[1]}") as popen:
        yield Proc(path, *ports, popen)


async def _metric(session: aiohttp.ClientSession, proc: Proc, name: str) -> float | None:
    async with session.get(proc.admin + "/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


async def _load(session: aiohttp.ClientSession, proc: Proc, stop: asyncio.Event) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []

    async def client() -> None:
        while not stop.is_set():
            results.append(await stream_completion(session, proc.base, 32))

    await asyncio.gather(*(client() for _ in range(8)))
    return results


async def test_sighup_applies_new_limit_under_load_and_keeps_old_on_error(daemon_proc: Proc) -> None:
    proc = daemon_proc
    ports = (int(proc.base.rsplit(":", 1)[1]), int(proc.admin.rsplit(":", 1)[1]))
    async with http_session() as s:
        assert await _metric(s, proc, "autopilot_admission_limit") == 4
        stop = asyncio.Event()
        load = asyncio.create_task(_load(s, proc, stop))
        await asyncio.sleep(1.0)
        _config(proc.path, ports, limit=6)
        t0 = time.monotonic()
        proc.popen.send_signal(signal.SIGHUP)
        while await _metric(s, proc, "autopilot_admission_limit") != 6:
            assert time.monotonic() - t0 < 2.0, "new limit not visible within 2 s"
            await asyncio.sleep(0.05)
        print(f"limit visible after {time.monotonic() - t0:.2f} s")

        _config(proc.path, ports, limit=9, extra="\n[admission.oops]\n")  # broken: unknown key
        proc.popen.send_signal(signal.SIGHUP)
        t0 = time.monotonic()
        while await _metric(s, proc, 'autopilot_config_reloads_total{result="error"}') != 1:
            assert time.monotonic() - t0 < 5.0, "reload error not counted"
            await asyncio.sleep(0.05)
        assert await _metric(s, proc, "autopilot_admission_limit") == 6  # the old config still serves
        await asyncio.sleep(1.0)
        stop.set()
        results = await load
        async with s.get(proc.admin + "/healthz") as r:
            assert r.status == 200
    assert len(results) > 8
    failed = [r for r in results if r["status"] != 200 or r["tokens"] != 32]
    assert failed == [], failed


async def test_post_reload_reports_errors(daemon_proc: Proc) -> None:
    async with http_session() as s, s.post(daemon_proc.admin + "/reload", json={}) as r:
        body = await r.json()
    assert r.status == 400 and not body["ok"]
    assert any("oops" in e for e in body["errors"]), body


async def test_engine_change_waits_then_restarts_with_restart_on_reload(daemon_proc: Proc) -> None:
    proc = daemon_proc
    ports = (int(proc.base.rsplit(":", 1)[1]), int(proc.admin.rsplit(":", 1)[1]))
    async with http_session() as s:
        _config(proc.path, ports, limit=6, kv_cache_memory_bytes=48 << 20)
        async with s.post(proc.admin + "/reload", json={}) as r:
            body = await r.json()
        assert body["pending"] == {"engine": ["kv_cache_memory_bytes"]} and body["engine_restart"] is None
        assert await _metric(s, proc, 'autopilot_config_reloads_total{result="pending_engine_restart"}') == 1

        _config(proc.path, ports, limit=6, kv_cache_memory_bytes=48 << 20, restart_on_reload=True)
        stop = asyncio.Event()
        load = asyncio.create_task(_load(s, proc, stop))
        await asyncio.sleep(1.0)
        proc.popen.send_signal(signal.SIGHUP)
        t0 = time.monotonic()
        while await _metric(s, proc, "autopilot_engine_generation") != 2:
            assert time.monotonic() - t0 < 240, "the guarded restart did not finish"
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        stop.set()
        results = await load
        async with s.get(proc.admin + "/state") as r:
            state = await r.json()
    assert await_restarts(state) and state["engine"]["kv_cache_memory_bytes"] == 48 << 20
    assert state["pending_config_changes"] == {}
    failed = [r for r in results if r["status"] != 200 or r["tokens"] != 32]
    assert failed == [], failed  # the drain let in-flight requests finish; queued ones waited


def await_restarts(state: dict[str, Any]) -> bool:
    return (
        bool(state["guard"]["last_restart"]) and state["guard"]["last_restart"]["reason"] == "config_reload"
    )


async def test_a_bad_engine_value_by_reload_keeps_the_working_engine_serving(daemon_proc: Proc) -> None:
    """A KV cache too small for one max_model_len sequence passes the file's checks but fails the
    engine build: the engine in force (48 MiB, generation 2, from the test before) keeps serving, and
    the file put back shows no change."""
    proc = daemon_proc
    ports = (int(proc.base.rsplit(":", 1)[1]), int(proc.admin.rsplit(":", 1)[1]))
    async with http_session() as s:
        _config(proc.path, ports, limit=6, kv_cache_memory_bytes=1 << 18, restart_on_reload=True)
        async with s.post(proc.admin + "/reload", json={}) as r:
            body = await r.json()
        assert body["ok"] and body["engine_restart"] == {"kv_cache_memory_bytes": 1 << 18}, body
        t0 = time.monotonic()
        await asyncio.sleep(0.5)
        while True:
            async with s.get(proc.admin + "/state") as r:
                state = await r.json()
            if not state["guard"]["restarting"]:
                break
            assert time.monotonic() - t0 < 240, "the failed restart did not end"
            await asyncio.sleep(0.2)
        assert state["engine"]["generation"] == 2 and state["engine"]["kv_cache_memory_bytes"] == 48 << 20
        assert state["guard"]["unavailable_reason"] is None
        served = await stream_completion(s, proc.base, 16)
        async with s.get(proc.admin + "/healthz") as h:
            health_status = h.status
        _config(proc.path, ports, limit=6, kv_cache_memory_bytes=48 << 20, restart_on_reload=True)
        async with s.post(proc.admin + "/reload", json={}) as r:
            back = await r.json()
    assert served["status"] == 200 and served["tokens"] == 16, served
    assert health_status == 200
    assert back["ok"] and back["pending"] == {} and back["engine_restart"] is None, back


async def test_sigterm_under_load_drains_and_exits_zero(daemon_proc: Proc) -> None:
    proc = daemon_proc
    async with http_session() as s:
        streams = [asyncio.create_task(stream_completion(s, proc.base, 300)) for _ in range(6)]
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*streams)
    code = await asyncio.get_running_loop().run_in_executor(None, proc.popen.wait, 60)
    elapsed = time.monotonic() - t0
    assert code == 0
    assert elapsed < 30.0 + 15.0, elapsed  # the drain deadline plus engine shutdown
    assert all(r["status"] == 200 and r["tokens"] == 300 for r in results), results
