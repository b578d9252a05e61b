"""The status page (``GET /`` of the control plane) in a real headless Chromium, from a daemon under load.

A few streams run on the tiny model while the page is open; the page must log no console error and
throw nothing, draw every series of every chart it shows with samples, and list the loop's decisions
with their reasons, and show the capacity at the SLO. Chromium is driven through the DevTools protocol
over aiohttp's websocket client (no selenium, no chromedriver). The screenshot goes to the test's
tmp_path (``docs/status-page.png`` is one of them).

The policy is ``slo`` with an ``[slo]`` (what config.toml runs) and a low admission limit: once the
step-cost fit is ready (50 engine steps, a second or two of this load) the policy raises the limit to
what the engine runs within the SLO, so a decision with its reason is there within the test's time.
Without a limit below that, the tiny model runs within the SLO at the ceilings and the policy, rightly,
changes nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import (
    admin_url,
    http_session,
    running_daemon,
    stream_completion,
    url,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STREAMS, TOKENS = 6, 128
WIDTH, HEIGHT = 1400, 1000
# Seconds the page keeps drawing after it shows everything: time for late errors; docs/status-page.png
# is a run with a longer history (README.md, "Control plane").
SETTLE_S = float(os.environ.get("STATUS_PAGE_SETTLE_S", "3"))
_DRAINS: set[asyncio.Task[bytes]] = set()  # the stderr readers, kept from the garbage collector


class Cdp:
    """One DevTools protocol connection to a page: commands by id, events kept in order."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.ws:
            data = message.json()
            future = self._pending.pop(data.get("id", -1), None)
            if future is None:
                self.events.append(data)
            elif "error" in data:
                future.set_exception(AssertionError(f"DevTools: {data['error']}"))
            else:
                future.set_result(data.get("result", {}))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        command_id = next(self._ids)
        self._pending[command_id] = future
        await self.ws.send_json({"id": command_id, "method": method, "params": params})
        return await asyncio.wait_for(future, 30)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def errors(self) -> list[dict[str, Any]]:
        """Console errors, uncaught exceptions and the browser's own error entries (a CSP violation, a
        failed fetch), as the DevTools console would show them."""
        return [
            e
            for e in self.events
            if (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")
            or e["method"] == "Runtime.exceptionThrown"
            or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
        ]

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def chromium(profile: Path) -> AsyncIterator[str]:
    """Headless Chromium on a free DevTools port; yields its HTTP endpoint (``http://127.0.0.1:PORT``)."""
    assert CHROMIUM is not None
    args = ["--headless=new", "--remote-debugging-port=0", f"--user-data-dir={profile}", "--no-sandbox"]
    args += ["--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", f"--window-size={WIDTH},{HEIGHT}"]
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, *args, "about:blank", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        yield await _devtools_endpoint(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def _devtools_endpoint(proc: asyncio.subprocess.Process) -> str:
    """The DevTools address Chromium prints on stderr; the rest of stderr is read on in the background,
    since a full pipe would block the browser."""
    assert proc.stderr is not None
    lines: list[str] = []
    async with asyncio.timeout(60):
        while not (m := re.search(r"DevTools listening on ws://([^/]+)/", lines[-1] if lines else "")):
            line = await proc.stderr.readline()
            assert line, "chromium exited: " + "".join(lines)
            lines.append(line.decode(errors="replace"))
    _DRAINS.add(asyncio.create_task(proc.stderr.read()))  # ends when the browser does
    return f"http://{m.group(1)}"


@contextlib.asynccontextmanager
async def page(endpoint: str) -> AsyncIterator[Cdp]:
    """A new tab, with the console, exceptions and the browser's log recorded from the start."""
    async with aiohttp.ClientSession() as session:
        async with session.put(f"{endpoint}/json/new?about:blank") as resp:
            target = await resp.json()
        ws = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        cdp = Cdp(ws)
        try:
            for domain in ("Runtime", "Log", "Page"):
                await cdp.send(f"{domain}.enable")
            await cdp.send(
                "Emulation.setDeviceMetricsOverride",
                width=WIDTH,
                height=HEIGHT,
                deviceScaleFactor=1,
                mobile=False,
            )
            yield cdp
        finally:
            await cdp.close()


# What the page drew, read from its DOM: per chart shown, the samples drawn for each legend entry
# (status.html marks each line with its series and its number of samples), and the decisions table.
READ_PAGE = """(() => {
  const charts = {};
  for (const svg of document.querySelectorAll("main svg")) {
    if (svg.closest("section").hidden) continue;
    const id = svg.id.slice(2);
    const names = [...document.querySelectorAll(`#l-${id} span`)].map(s => s.textContent);
    const drawn = names.map(() => 0);
    for (const line of svg.querySelectorAll("[data-series]")) drawn[+line.dataset.series] += +line.dataset.n;
    charts[id] = Object.fromEntries(names.map((name, k) => [name, drawn[k]]));
  }
  const decisions = [...document.querySelectorAll("#decisions tr")]
    .map(tr => [...tr.cells].map(c => c.textContent));
  const capacity = document.getElementById("s-capacity").hidden ? null : Object.fromEntries(
    [...document.querySelectorAll("#capacity tr")]
      .map(tr => [tr.cells[0].textContent, tr.cells[1].textContent]));
  return {charts, decisions, capacity, health: document.getElementById("health").textContent,
          error: document.getElementById("error").textContent};
})()"""


def _complete(drawn: dict[str, Any]) -> bool:
    return (
        bool(drawn["charts"])
        and bool(drawn["decisions"])
        and (drawn["capacity"] or {}).get("reason") == "ok"
        and all(n >= 2 for series in drawn["charts"].values() for n in series.values())
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("page") / "config.toml",
        admission={"limit": 2},
        control={"policy": "slo", "cost_profile": "cpu-tiny"},
        slo={"ttft_s": 5.0, "tpot_s": 0.25},
    )
    async with running_daemon(path) as d:
        yield d


@contextlib.asynccontextmanager
async def load(d: Daemon) -> AsyncIterator[list[dict[str, Any]]]:
    """``STREAMS`` clients streaming one completion after another until the block ends."""
    results: list[dict[str, Any]] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while True:
            results.append(await stream_completion(session, url(d, ""), TOKENS))

    async with http_session() as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(STREAMS)]
        try:
            yield results
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (make test installs Debian's chromium)")
async def test_status_page_draws_under_load(daemon: Daemon, tmp_path: Path) -> None:
    async with load(daemon) as results, chromium(tmp_path / "profile") as endpoint, page(endpoint) as cdp:
        await wait_for(lambda: any(r["status"] == 200 for r in results), 120, "a first finished stream")
        await cdp.send("Page.navigate", url=admin_url(daemon, "/"))
        drawn: dict[str, Any] = {}
        for _ in range(60):  # the page polls /state every second; its charts need two samples
            await asyncio.sleep(1)
            drawn = await cdp.evaluate(READ_PAGE)
            if _complete(drawn):
                break
        await asyncio.sleep(SETTLE_S)
        drawn = await cdp.evaluate(READ_PAGE)
        shot = await cdp.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        (tmp_path / "status-page.png").write_bytes(base64.b64decode(shot["data"]))
        errors = cdp.errors()
    assert errors == [], errors
    assert drawn["error"] == "" and drawn["health"] == "serving", drawn
    assert {"knobs", "queue", "ttft", "tpot", "rate"} <= set(drawn["charts"]), drawn["charts"]
    empty = {
        (chart, name) for chart, series in drawn["charts"].items() for name, n in series.items() if n < 2
    }
    assert not empty, f"series drawn with fewer than two samples: {sorted(empty)}"
    assert drawn["decisions"], "no decision listed"
    _, knob, change, reason = drawn["decisions"][0]
    assert knob and "→" in change and reason.startswith("slo"), drawn["decisions"]
    # the capacity at the SLO, from the step-cost fit and the load's mix (the autoscaler's signal)
    assert drawn["capacity"] is not None and drawn["capacity"]["reason"] == "ok", drawn["capacity"]
    assert float(drawn["capacity"]["saturation"]) > 0, drawn["capacity"]
    assert sum(r["status"] == 200 for r in results) >= STREAMS
