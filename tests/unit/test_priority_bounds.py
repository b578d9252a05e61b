"""Operators bound the priority clients may ask for: ``[admission]
most_urgent_priority`` (more urgent is refused with 400) and ``default_priority`` (a request naming none); a
value past vLLM's int64 or not an integer is refused with 400 before the gate, so it never counts,
queues or sheds. vLLM's serving object is replaced by a fake with the same shape (``_check_model``
first, as vLLM's handlers) and a pydantic request, as vLLM's own."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from controller.admission.classes import PRIORITY_MAX, PriorityBounds, PriorityClass, PriorityRefused
from controller.admission.gate import AdmissionGate
from controller.config.load import ConfigError, parse_config
from controller.engine.frontend.app import AdmissionMiddleware
from controller.engine.frontend.client import GovernedEngineClient
from controller.engine.frontend.priority import resolve_priorities
from tests.helpers import Events, FakeHost, Recorder

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = tomllib.loads((ROOT / "config.toml").read_text())


class CompletionRequest(BaseModel):
    priority: int = 0


class FakeLLM:
    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[int]:
        yield kwargs["priority"]


class FakeServing:
    """vLLM's serving shape: _check_model, _get_priority (header, else body), _preflight,
    create_error_response."""

    def __init__(self, client: GovernedEngineClient) -> None:
        self.client = client

    @staticmethod
    def _get_priority(request: CompletionRequest, raw_request: Request | None) -> int:
        if raw_request is not None and (header := raw_request.headers.get("x-vllm-priority")) is not None:
            try:
                return int(header)
            except ValueError:
                pass
        return request.priority

    @staticmethod
    def create_error_response(message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": message, "param": param}, status_code=400)

    def _preflight(self, n: int = 1) -> None:
        self.client.check_admission(n)

    async def _check_model(self, request: CompletionRequest) -> Any:
        return None

    async def create_completion(self, request: CompletionRequest, raw_request: Request | None = None) -> Any:
        if (error := await self._check_model(request)) is not None:
            return error
        self._preflight()
        stream = self.client.generate("p", None, "id", priority=self._get_priority(request, raw_request))
        return {"priority": [x async for x in stream]}


def make_app(bounds: PriorityBounds) -> tuple[httpx.AsyncClient, AdmissionGate, Events]:
    classes = (
        PriorityClass("interactive", max_priority=0, max_queue=8),
        PriorityClass("batch", min_priority=1, max_queue=8),
    )
    events = Events()
    gate = AdmissionGate(4, 100, classes, events=Recorder([], events))
    app = FastAPI()
    app.state.serving = FakeServing(GovernedEngineClient(FakeHost(FakeLLM()), gate, lambda: None))  # type: ignore[arg-type]
    assert resolve_priorities(app.state) == 1

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Any:
        body = CompletionRequest.model_validate(await raw_request.json())
        return await app.state.serving.create_completion(body, raw_request)

    transport = httpx.ASGITransport(app=AdmissionMiddleware(app, gate, lambda: bounds))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://test"), gate, events


BOUNDS = PriorityBounds(most_urgent=0, default=5)


@pytest.mark.parametrize(
    ("body", "headers", "says"),
    [
        ({"priority": -1}, {}, "priority -1 is out of range: this server accepts 0 (most urgent)"),
        ({}, {"X-Vllm-Priority": str(-(2**31))}, f"priority {-(2**31)} is out of range"),
        ({"priority": 2**63}, {}, f"priority {2**63} is out of range"),
        ({}, {"X-Vllm-Priority": str(2**64)}, f"priority {2**64} is out of range"),
        ({}, {"X-Vllm-Priority": "urgent"}, "priority 'urgent' is not an integer"),
    ],
)
async def test_priority_out_of_bounds_is_refused_with_400_before_the_gate(
    body: dict[str, Any], headers: dict[str, str], says: str
) -> None:
    http, gate, events = make_app(BOUNDS)
    async with http:
        r = await http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["param"] == "priority" and says in r.json()["error"]
    assert events.admitted == [] and events.rejected == []
    assert gate.stats().pending == 0 and gate.stats().in_flight == 0


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("X-Vllm-Priority", "9" * 5000),  # past int()'s digit limit: not an integer
        ("X-Vllm-Priority", "9" * 4000),  # an integer, out of range
        ("X-Autopilot-Ttft-Ms", "9" * 5000),
        ("X-Autopilot-Class", "c" * 5000),
    ],
)
async def test_a_refused_header_is_named_in_the_400_never_echoed_whole(header: str, value: str) -> None:
    http, _, _ = make_app(BOUNDS)
    async with http:
        r = await http.post("/v1/completions", json={}, headers={header: value})
    assert r.status_code == 400 and len(r.text) < 500 and value[:100] not in r.text, r.text[:200]
    assert f"({len(value)} " in r.json()["error"]  # its length named instead


@pytest.mark.parametrize(
    ("body", "headers", "priority", "cls"),
    [
        ({}, {}, 5, "batch"),  # names none: the default
        ({"priority": 0}, {}, 0, "interactive"),  # the most urgent allowed
        ({"priority": 9}, {"X-Vllm-Priority": "0"}, 0, "interactive"),  # the header wins, as in vLLM
        ({"priority": PRIORITY_MAX}, {}, PRIORITY_MAX, "batch"),
    ],
)
async def test_priority_within_bounds_reaches_gate_and_engine(
    body: dict[str, Any], headers: dict[str, str], priority: int, cls: str
) -> None:
    http, _, events = make_app(BOUNDS)
    async with http:
        r = await http.post("/v1/completions", json=body, headers=headers)
    assert (r.status_code, r.json()) == (200, {"priority": [priority]})
    assert [c for c, _ in events.admitted] == [cls]


def test_default_bounds_accept_any_int64_and_default_to_zero() -> None:
    b = PriorityBounds()
    assert (b.resolve(None), b.resolve(-(2**63)), b.resolve(str(PRIORITY_MAX))) == (0, -(2**63), PRIORITY_MAX)
    with pytest.raises(PriorityRefused):
        b.resolve(2**63)


def _doc(**admission: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["admission"] = {**data.get("admission", {}), **admission}
    return data


def test_admission_bounds_load_from_config() -> None:
    config = parse_config(_doc(most_urgent_priority=0, default_priority=1), ROOT / "config.toml")
    assert config.admission.priority_bounds == PriorityBounds(most_urgent=0, default=1)


@pytest.mark.parametrize(
    ("admission", "error"),
    [
        (
            {"most_urgent_priority": 0, "default_priority": -1},
            "[admission] default_priority = -1: below most_urgent_priority = 0, so a request naming none "
            "would be refused; raise it",
        ),
        ({"most_urgent_priority": 2**63 - 1 + 0, "default_priority": 0}, "below most_urgent_priority"),
        ({"most_urgent_priority": "0"}, "[admission] most_urgent_priority = '0': must be int."),
    ],
)
def test_admission_bounds_are_validated(admission: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(_doc(**admission), ROOT / "config.toml")
    assert any(error in e for e in exc.value.errors), exc.value.errors
