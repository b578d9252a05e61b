"""The warm-up on the real engine (tiny model): a daemon with no cost profile fits the step-cost model
from synthetic requests before it serves, says so in /state, stores the fit, and the next start with
the same engine reads it back instead of warming up again. Forty streams right after start on the
default config's admission and policy are all served (no refusal while the fit is young), and each
is counted as good against the shipped [slo]."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from controller.config.load import load_config
from tests.helpers import (
    admin_url,
    http_session,
    running_daemon,
    shipped_config,
    stream_completion,
    url,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


def config(path: Path, tiny_model: Path) -> Path:
    shipped = shipped_config()
    return write_config(
        path,
        engine={"model": str(tiny_model)},
        admission=shipped["admission"],
        slo=shipped["slo"],
        control={**shipped["control"], "warmup_s": 10.0},
    )


async def test_a_warm_up_fits_the_model_before_serving_and_the_next_start_reads_it(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    path = config(tmp_path / "config.toml", tiny_model)
    assert load_config(path).control.policy == "slo" and load_config(path).control.cost_profile == ""
    async with running_daemon(path) as d, http_session() as s:
        state = await (await s.get(admin_url(d, "/state"))).json()
        warm = state["cost_model"]["warm_start"]
        assert warm["source"] == "warm-up", warm
        assert warm["steps"] >= 20 and 0 < warm["seconds"] <= 2 * 10.0
        assert warm["coefficients"]["a_s"] > 0 and warm["median_rel_error"] < 0.5, warm
        assert state["cost_model"]["seed"].startswith("warm-up: ")
        stored = json.loads(Path(warm["path"]).read_text())
        assert stored["coefficients"] == warm["coefficients"]
        results = await asyncio.gather(*(stream_completion(s, url(d, ""), 32) for _ in range(40)))
        ledger = d.parts.outcomes
        await wait_for(  # the stat logger reports finished requests with the engine's next steps
            lambda: ledger.served_total + ledger.unmatched >= 40, 30, "every finished request reported"
        )
        outcomes = (await (await s.get(admin_url(d, "/state"))).json())["outcomes"]
    assert [r["status"] for r in results] == [200] * 40, results
    # each served request judged against the shipped [slo] (tiny: far within 5 s / 250 ms)
    counts = outcomes["by_class"]["interactive"]
    assert sum(counts.values()) == 40 and counts["good"] == 40, outcomes
    assert outcomes["unmatched"] == 0 and outcomes["attainment"] == 1.0
    async with running_daemon(path) as again, http_session() as s:
        warm_again = (await (await s.get(admin_url(again, "/state"))).json())["cost_model"]["warm_start"]
    assert warm_again["source"] == "state_file" and warm_again["coefficients"] == warm["coefficients"]
