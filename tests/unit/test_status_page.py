"""The status page at GET / of the control plane: served with and without the admin token, fetches
nothing from outside, and reads only fields that a real /state (built by the status module from real
parts) has; its data functions run under node on real states, with and without the optional fields.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import inspect
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from controller.admin.page import page
from controller.admin.server import make_admin_app
from controller.control.loop import Change
from controller.lifecycle import guard
from tests.helpers import write_config

HTML = page()[0].decode()
SCRIPT = re.search(r"<script>(.*?)</script>", HTML, re.DOTALL).group(1)  # type: ignore[union-attr]


def _accesses(fn: str, obj: str) -> set[str]:
    return set(re.findall(rf'\b{fn}\({obj}, "([\w.]+)"\)', SCRIPT))


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """/state of a daemon's real parts (no engine started): one with every optional table, one bare."""
    from controller.admin.status import state
    from controller.config.load import load_config
    from controller.lifecycle.parts import build_parts

    folder = tmp_path_factory.mktemp("status")
    full = write_config(
        folder / "full.toml",
        slo={"ttft_s": 2.5, "tpot_s": 0.07},
        control={"policy": "static", "cost_profile": "cpu-tiny"},
    )
    bare = write_config(folder / "bare.toml")
    out = {name: state(build_parts(load_config(path))) for name, path in (("full", full), ("bare", bare))}
    return json.loads(json.dumps(out))  # as the browser gets it


def _resolves(state: dict[str, Any], path: str) -> bool:
    """Every key on the path exists; a null object on the way (no diagnosis yet) ends the walk."""
    node: Any = state
    for key in path.split("."):
        if node is None:
            return True
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _app(state: dict[str, Any], token: str) -> Any:
    async def reload() -> dict[str, Any]:
        return {"ok": True}

    return make_admin_app(CollectorRegistry(), lambda: state, lambda: (True, "serving"), reload, token=token)


@pytest.mark.parametrize("token", ["", "s3cret-token"])
async def test_get_root_serves_the_page_and_state_keeps_its_token(
    token: str, states: dict[str, dict[str, Any]]
) -> None:
    async with TestClient(TestServer(_app(states["full"], token))) as client:
        response = await client.get("/")  # the page holds no data: open, like /metrics
        assert response.status == 200 and response.content_type == "text/html"
        assert "<title>vllm-autopilot</title>" in await response.text()
        assert "connect-src 'self'" in response.headers["Content-Security-Policy"]
        assert (await client.get("/state")).status == (401 if token else 200)
        authorized = await client.get("/state", headers={"Authorization": f"Bearer {token}"})
        assert (
            authorized.status == 200 and (await authorized.json())["batch_cap"] == states["full"]["batch_cap"]
        )
        assert (await client.get("/metrics")).status == 200  # the page reads restarts there


def test_the_page_fetches_nothing_from_outside() -> None:
    assert not re.search(r"https?://|//[a-z0-9-]+\.[a-z]", HTML, re.IGNORECASE)
    assert not re.search(r"<(link|img|iframe)\b|\bsrc\s*=|@import|url\(", HTML, re.IGNORECASE)
    assert set(re.findall(r'fetch\("([^"]+)"', SCRIPT)) == {"state", "metrics"}  # same origin, relative
    assert "innerHTML" not in SCRIPT.replace("svg.innerHTML = out", "")  # data goes in by textContent


def test_the_csp_pins_the_inline_script_by_its_hash() -> None:
    digest = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in page()[1]


def test_every_state_field_the_page_reads_is_in_state(states: dict[str, dict[str, Any]]) -> None:
    required = _accesses("get", "s")
    assert {"admission_limit", "batch_cap", "engine_stats.kv_usage", "decisions"} <= required
    for name, state in states.items():
        missing = [p for p in sorted(required) if not _resolves(state, p)]
        assert not missing, f"{name} /state lacks {missing}"
    optional = _accesses("opt", "s")
    assert {"token_budget", "slo.ttft_s", "slo.tpot_s", "cost_model"} <= optional
    assert {"outcomes", "outcomes.goodput_rps", "policy.terms.mean_margin"} <= optional
    for path in optional:
        # the full state runs the static policy: the slo policy's objective and learned margin are its own
        if path not in ("policy.terms.mean_margin", "policy.params.objective"):
            assert _resolves(states["full"], path), path
    assert states["bare"]["slo"] is None  # no [slo]: the page draws no SLO line


def test_decision_and_restart_fields_are_the_ones_the_daemon_writes() -> None:
    assert _accesses("get", "d") <= {f.name for f in dataclasses.fields(Change)}
    written = set(
        re.findall(
            r'"(\w+)":', inspect.getsource(guard.Guard).split("self.last_restart = {")[1].split("}")[0]
        )
    )
    assert _accesses("get", "last") <= written


def _node(states: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    (tmp_path / "page.js").write_text(SCRIPT)
    driver = (
        "const p = require('./page.js');"
        "const states = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "const metrics = 'autopilot_engine_restarts_total{reason=\"engine_died\"} 2.0\\n'"
        " + 'autopilot_engine_restarts_total{reason=\"gpu_memory_low\"} 1.0\\n';"
        "console.log(JSON.stringify(states.map(s => ({sample: p.sample(s), facts: p.facts(s),"
        " restarts: p.restartsFrom(metrics)}))));"
    )
    run = subprocess.run(
        [node, "-e", driver],
        input=json.dumps(states),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    result: list[dict[str, Any]] = json.loads(run.stdout)
    return result


def test_the_page_reads_real_states_and_skips_absent_fields(
    states: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    older = {k: v for k, v in states["bare"].items() if k not in ("slo", "cost_model", "token_budget")}
    with_decision = json.loads(json.dumps(states["full"]))
    change = Change("batch_cap", 16, 8, "kv_high", 1.0, 1_700_000_000.0)
    with_decision["decisions"] = [dataclasses.asdict(change)]
    full, bare, old, decided = _node([states["full"], states["bare"], older, with_decision], tmp_path)
    assert full["sample"]["sloTtft"] == 2.5 and full["sample"]["sloTpot"] == 0.07
    assert (
        full["facts"]["cost"][0][0] == "ready"
        and full["sample"]["limit"] == states["full"]["admission_limit"]
    )
    assert bare["sample"]["sloTtft"] is None and bare["sample"]["sloTpot"] is None
    # a /state without the fields newer parts add: the page skips them
    assert (
        old["sample"]["budget"] is None and old["sample"]["sloTpot"] is None and old["facts"]["cost"] is None
    )
    assert decided["facts"]["decisions"][0][1:] == ["batch_cap", "16 → 8", "kv_high"]
    assert full["restarts"] == 3
    # the page leads with goodput: the outcome window's figures, the objective, the learned margin
    assert full["facts"]["goodput"][:4] == [
        ["goodput (good requests/s)", 0],
        ["SLO attainment", "–"],
        ["objective", "TTFT <= 2.50 s, TPOT <= 0.0700 s"],
        ["mean step share of the TPOT bound (learned)", None],
    ]
    assert full["sample"]["goodput"] == 0 and old["facts"]["goodput"] is not None
    assert full["facts"]["memory"].startswith("kv_cache_memory_bytes 64 MiB")


def test_the_diagnosis_shows_its_throughput_table_as_text(
    states: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    diagnosed = json.loads(json.dumps(states["full"]))
    diagnosed["diagnosis"] = {
        "saturated": False,
        "bottleneck": None,
        "throughput_by_concurrency": {"2": 1.5, "4": 2.75},
    }
    (out,) = _node([diagnosed], tmp_path)
    assert out["facts"]["diagnosis"] == [
        ["saturated", "false"],
        ["bottleneck", "–"],
        ["throughput by concurrency", "2: 1.50, 4: 2.75"],
    ]


async def test_favicon_answers_no_content(states: dict[str, dict[str, Any]]) -> None:
    """A browser asks for /favicon.ico beside the page; a 404 would be an error in its console."""
    async with TestClient(TestServer(_app(states["full"], "s3cret-token"))) as client:
        response = await client.get("/favicon.ico")
        assert response.status == 204 and await response.read() == b""


def test_the_capacity_panel_shows_what_an_autoscaler_reads(
    states: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    measured = json.loads(json.dumps(states["full"]))
    measured["capacity"] = {
        "saturation": 1.25, "capacity_rps": 3.2, "offered_rps": 4.0, "reason": "ok", "batch": 12,
        "bound": "tpot", "mean_step_s": 0.034, "step_bound_s": 0.035,
    }  # fmt: skip
    older = {k: v for k, v in states["full"].items() if k != "capacity"}
    out, old = _node([measured, older], tmp_path)
    assert out["facts"]["capacity"][:4] == [
        ["saturation", 1.25],
        ["capacity (good requests/s)", 3.2],
        ["offered (requests/s)", 4.0],
        ["batch at capacity", "12 (bound: tpot)"],
    ]
    assert out["facts"]["capacity"][-1] == ["reason", "ok"]
    assert old["facts"]["capacity"] is None  # a daemon without the meter: the panel is hidden
