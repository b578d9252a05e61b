"""The systemd unit and its example drop-in: systemd-analyze accepts them, the settings the daemon
relies on (notify protocol, watchdog, SIGHUP reload, GPU access) are there, and so is the hardening
that keeps the GPUs usable (no capabilities, no namespaces, other users' processes hidden)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "vllm-autopilot.service"
DROP_IN = ROOT / "systemd" / "vllm-autopilot.service.d" / "override.conf.example"


def directives(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file, by key, in order (a key may repeat)."""
    out: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key, [])
    assert len(values) == 1, f"{key}: expected exactly one value, got {values}"
    return values[0]


def test_key_settings() -> None:
    s = directives(UNIT.read_text())
    assert one(s, "Type") == "notify"
    assert one(s, "NotifyAccess") == "main"
    assert one(s, "ExecStart") == (
        "/opt/vllm-autopilot/.venv/bin/vllm-autopilot serve --config /etc/vllm-autopilot/config.toml"
    )
    assert one(s, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(s, "WatchdogSec") == "30"
    assert one(s, "TimeoutStartSec") == "600"
    assert int(one(s, "TimeoutStopSec")) >= 30 + 60  # default drain deadline + engine stop
    assert one(s, "KillMode") == "mixed"
    assert one(s, "Restart") == "on-failure"
    assert one(s, "User") == one(s, "Group") == "vllm-autopilot"
    assert "DynamicUser" not in s
    assert one(s, "StateDirectory") == one(s, "CacheDirectory") == "vllm-autopilot"
    env = dict(v.split("=", 1) for v in s["Environment"])
    assert env["HOME"] == "/var/lib/vllm-autopilot"
    for var in ("HF_HOME", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        assert env[var].startswith("/var/cache/vllm-autopilot"), var
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "RestrictRealtime": "yes",
        "SystemCallArchitectures": "native",
    }.items():
        assert one(s, key) == value, key
    assert one(s, "ProtectHome") in ("yes", "read-only")


def test_keeps_gpu_and_shared_memory_access() -> None:
    for path in (UNIT, DROP_IN):
        s = directives(path.read_text())
        assert s.get("PrivateDevices", ["no"]) == ["no"], path  # hides /dev/nvidia*
        assert "ProtectClock" not in s, path  # implies a device allow-list
        assert "MemoryDenyWriteExecute" not in s, path  # Triton / CUDA JIT
        assert not any(
            "/dev/shm" in v for key in ("InaccessiblePaths", "TemporaryFileSystem") for v in s.get(key, [])
        )
        assert "DevicePolicy" not in s, path  # opt-in only, commented out in the drop-in


def test_drop_in_is_loadable_as_is() -> None:
    s = directives(DROP_IN.read_text())
    assert any(v.startswith("CUDA_VISIBLE_DEVICES=") for v in s["Environment"])
    assert "WatchdogSec" in s


def _verifiable_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart= on a binary that exists here, beside the drop-in as override.conf.

    systemd-analyze verify fails on a missing ExecStart binary; User=/Group= are dropped too so that
    the check does not depend on the service user existing on the test host.
    """
    text = UNIT.read_text()
    text = re.sub(r"(?m)^ExecStart=\S+", "ExecStart=/bin/true", text)
    text = re.sub(r"(?m)^(User|Group)=.*\n", "", text)
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    drop_in_dir = tmp_path / (UNIT.name + ".d")
    drop_in_dir.mkdir()
    shutil.copy(DROP_IN, drop_in_dir / "override.conf")
    return unit


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = _verifiable_copy(tmp_path)
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    about_us = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert about_us == [], "\n".join(about_us)
    assert result.returncode == 0, result.stdout + result.stderr


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above is meaningful: the same set-up reports a mistyped setting."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = _verifiable_copy(tmp_path)
    unit.write_text(unit.read_text().replace("Type=notify", "Type=notfy"))
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert "notfy" in result.stdout + result.stderr


def test_an_oom_killed_engine_core_does_not_stop_the_service() -> None:
    """systemd's default OOMPolicy=stop ends the service when the kernel kills any of its processes;
    the daemon recovers its EngineCore itself, so the service must carry on."""
    s = directives(UNIT.read_text())
    assert one(s, "OOMPolicy") == "continue"


def test_no_capabilities_no_namespaces_and_other_processes_hidden() -> None:
    s = directives(UNIT.read_text())
    assert one(s, "ProtectProc") == "invisible"
    assert one(s, "RestrictNamespaces") == "yes"
    assert one(s, "CapabilityBoundingSet") == ""  # empty: the bounding set holds no capability
    assert "AmbientCapabilities" not in s
    # ProcSubset=pid would hide /proc/meminfo (the memory guard's psutil reading) and /proc/driver/nvidia
    assert "ProcSubset" not in s


def test_memory_and_task_limits_are_left_to_the_host_with_guidance() -> None:
    """MemoryMax= and TasksMax= depend on the host's model and cores: the unit sets neither, says how
    to size them, and the example drop-in carries both, commented out."""
    text = UNIT.read_text()
    s = directives(text)
    assert "MemoryMax" not in s and "TasksMax" not in s
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "MemoryMax=" in comments and "TasksMax=" in comments
    assert "OOMPolicy=continue" in comments  # why a cgroup limit is the safer place for an OOM kill
    drop_in = DROP_IN.read_text().splitlines()
    assert any(re.fullmatch(r"#MemoryMax=\d+G", line) for line in drop_in)
    assert any(re.fullmatch(r"#TasksMax=\d+", line) for line in drop_in)


def test_the_drop_in_limits_are_valid_once_uncommented(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = _verifiable_copy(tmp_path)
    drop_in = unit.parent / (unit.name + ".d") / "override.conf"
    drop_in.write_text(re.sub(r"(?m)^#((MemoryMax|TasksMax)=)", r"\1", drop_in.read_text()))
    assert "\nMemoryMax=" in drop_in.read_text() and "\nTasksMax=" in drop_in.read_text()
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    about_us = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert about_us == [] and result.returncode == 0, result.stdout + result.stderr
