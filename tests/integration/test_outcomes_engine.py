"""vLLM's finished-request stats reach the outcome ledger from the real engine (the tiny model on the
CPU): one ``served`` call per completion, with the engine's TTFT (e2e latency less decode time) and a
mean TPOT. The ledger here is handed to the engine host by the test, as the daemon's wiring would."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config.load import load_config
from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, url, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

TOKENS = 8


class Sink:
    """Records what the stat logger reports."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, float, float | None, bool]] = []
        self.first_tokens: dict[str, float] = {}
        self.asked: dict[str, int | None] = {}
        self.output_tokens: dict[str, int | None] = {}

    def started(
        self,
        request_id: str,
        cls: str,
        before_engine_s: float,
        n: int = 1,
        ttft_s: float | None = None,
        max_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        self.asked[request_id] = max_tokens

    def first_token(self, request_id: str, engine_ttft_s: float) -> None:
        self.first_tokens[request_id] = engine_ttft_s

    def served(
        self,
        request_id: str,
        engine_ttft_s: float,
        tpot_s: float | None,
        error: bool = False,
        output_tokens: int | None = None,
    ) -> None:
        self.reports.append((request_id, engine_ttft_s, tpot_s, error))
        self.output_tokens[request_id] = output_tokens


async def test_each_finished_request_reaches_the_ledger_with_its_ttft_and_tpot(
    tmp_path: Path, tiny_model: Path
) -> None:
    d = Daemon(load_config(write_config(tmp_path / "config.toml")), install_signals=False)
    sink = Sink()
    d.parts.host.outcomes = sink
    try:
        await d.startup()
        async with http_session() as s:
            for i in range(3):
                body = {"model": "tiny", "prompt": f"hello {i}", "max_tokens": TOKENS, "ignore_eos": True}
                async with s.post(url(d, "/v1/completions"), json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.json()
    finally:
        await d.shutdown()
    assert len(sink.reports) == 3, sink.reports
    for request_id, ttft, tpot, error in sink.reports:
        assert request_id and not error
        assert 0 < ttft < 30 and tpot is not None and 0 < tpot < 30
        # the engine client reported each one's first token too, by which the ledger judges the TTFT
        assert 0 < sink.first_tokens[request_id] <= ttft + 0.5
        # the answer's length and what it asked for: the slo budget's short answers
        assert sink.output_tokens[request_id] == TOKENS and sink.asked[request_id] == TOKENS
