"""The daemon's ports: the data plane's is bound before the engine is built, as `vllm serve` binds its
own, so nothing the EngineCore opens while it starts can take it; a port another process holds fails
startup at once with a message naming the port and the config key, before any engine is built. The
parts are real (nothing served); the engine host's start is a fake that records it was called."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from controller.config.load import load_config
from controller.lifecycle.daemon import Daemon, ListenError
from tests.helpers import free_port, write_config


def held_port() -> socket.socket:
    """A port another process (here: this test) listens on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def daemon_on(tmp_path: Path, data_port: int, admin_port: int) -> tuple[Daemon, list[str]]:
    path = write_config(
        tmp_path / "config.toml",
        server={"host": "127.0.0.1", "port": data_port},
        admin={"host": "127.0.0.1", "port": admin_port},
    )
    d = Daemon(load_config(path), install_signals=False)
    started: list[str] = []

    async def fake_start() -> None:
        started.append("engine")
        raise RuntimeError("the test stops here: the ports were bound before this")

    d.parts.host.start = fake_start  # type: ignore[method-assign]
    return d, started


async def test_a_data_plane_port_in_use_fails_before_the_engine_is_built(tmp_path: Path) -> None:
    with held_port() as other:
        port = other.getsockname()[1]
        d, started = daemon_on(tmp_path, port, free_port())
        with pytest.raises(ListenError) as err:
            await d.startup()
        await d.shutdown()
    assert started == []
    assert f"127.0.0.1:{port}" in str(err.value) and "[server]" in str(err.value)


async def test_an_admin_port_in_use_fails_with_its_key_named(tmp_path: Path) -> None:
    with held_port() as other:
        port = other.getsockname()[1]
        d, started = daemon_on(tmp_path, free_port(), port)
        with pytest.raises(ListenError) as err:
            await d.startup()
        await d.shutdown()
    assert started == []
    assert f"127.0.0.1:{port}" in str(err.value) and "[admin]" in str(err.value)


async def test_the_data_plane_port_is_held_while_the_engine_builds(tmp_path: Path) -> None:
    port = free_port()
    d, started = daemon_on(tmp_path, port, free_port())
    with pytest.raises(RuntimeError, match="the ports were bound"):
        await d.startup()
    assert started == ["engine"]
    probe = socket.socket()
    with pytest.raises(OSError):  # held by the daemon: nothing else binds it during the build
        probe.bind(("127.0.0.1", port))
    probe.close()
    await d.shutdown()
    with socket.socket() as again:  # and let go at shutdown
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
