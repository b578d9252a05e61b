"""``bench frontend --layers``: the CPU each layer of the daemon's request path adds, in one process,
without servers or an engine, so that it is measured to the microsecond on a box whose load drifts.

A burst of ``streams`` requests runs at once through a stand-in for vLLM's streaming handler (one
ASGI body message per engine output, as vLLM's SSE generator writes one per delta) over a fake engine
that yields ``outputs`` delta ``RequestOutput``s, one per loop turn. The stacks, each adding one layer
of ours to the one before:

* ``bare``: the handler reads the engine directly (what ``vllm serve`` runs, less vLLM's own code);
* ``client``: through ``GovernedEngineClient`` (admission, the gate's slot, the output pump);
* ``middleware``: and ``AdmissionMiddleware`` (the request's context, the held status line);
* ``limits``: and ``ClientLimits`` (the body count, the send timeout): the daemon's whole stack.

Each stack runs ``rounds`` times, the stacks in turn, and its figure is the median over rounds of the
process CPU per request; a layer's cost is its stack's figure less the one before. The scheduler
subclass's per-step work (the decode check, the step meter) is measured the same way, per step with
``streams`` decoding requests, against vLLM's ``schedule()`` and ``update_from_output()`` stubbed out.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

STACKS = ("bare", "client", "middleware", "limits")
SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
Handler = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def _output(i: int, finished: bool) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(0, "x", [i], None, None, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], None, [completion], finished)


class _Engine:
    """An engine that yields ``outputs`` deltas per request, one each loop turn."""

    def __init__(self, outputs: int) -> None:
        self.outputs = outputs

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        for i in range(self.outputs):
            await asyncio.sleep(0)
            yield _output(i, i == self.outputs - 1)


class _Host:
    def __init__(self, llm: _Engine) -> None:
        self.llm = llm
        self.in_flight: dict[int, Any] = {}
        self.aborted: dict[int, str] = {}
        self.outcomes = None  # nothing counts the layers' requests


def _handler(engine: Any, governed: bool) -> Handler:
    """vLLM's streaming completion as the layers see it: the preflight, then one message per output."""
    from vllm.sampling_params import RequestOutputKind

    params = SimpleNamespace(n=1, output_kind=RequestOutputKind.DELTA)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        if governed:
            engine.check_admission(1)
        stream = engine.generate("p", params, "r")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async for output in stream:
            body = f"data: {output.outputs[0].text}\n\n".encode()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


def build(stack: str, streams: int, outputs: int) -> Handler:
    """The ASGI app of ``stack`` (one of ``STACKS``) over a fresh fake engine and gate."""
    from controller.admission.gate import AdmissionGate
    from controller.engine.frontend.app import AdmissionMiddleware
    from controller.engine.frontend.client import GovernedEngineClient
    from controller.engine.frontend.limits import ClientLimits, ServerLimits

    engine = _Engine(outputs)
    if stack == "bare":
        return _handler(engine, governed=False)
    gate = AdmissionGate(streams, streams)
    client = GovernedEngineClient(_Host(engine), gate, lambda: None)  # type: ignore[arg-type]
    app: Handler = _handler(client, governed=True)
    if stack in ("middleware", "limits"):
        app = AdmissionMiddleware(app, gate)
    if stack == "limits":
        app = ClientLimits(app, ServerLimits())
    return app


async def _burst(app: Handler, streams: int) -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    await asyncio.gather(*(app(dict(SCOPE), receive, send) for _ in range(streams)))


def measure_stacks(streams: int, outputs: int, bursts: int, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of each stack's process CPU in microseconds per request."""
    samples: dict[str, list[float]] = {s: [] for s in STACKS}
    loop = _new_loop()
    try:
        for _ in range(rounds):
            for stack in STACKS:
                app = build(stack, streams, outputs)
                loop.run_until_complete(_burst(app, streams))  # warm: imports, first allocations
                start = time.process_time()
                for _ in range(bursts):
                    loop.run_until_complete(_burst(app, streams))
                samples[stack].append((time.process_time() - start) / (bursts * streams) * 1e6)
    finally:
        loop.close()
    return {s: statistics.median(v) for s, v in samples.items()}


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's, as both servers run it; asyncio's where it is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def measure_step(streams: int, steps: int, rounds: int) -> dict[str, float]:
    """The scheduler subclass's own work per step in microseconds (median over ``rounds``): its
    ``schedule()`` and ``update_from_output()`` over stubs of vLLM's, with ``streams`` decoding
    requests, against the stubs alone."""
    from controller.engine.runtime.scheduler import _LiveKnobsMixin

    requests = {
        str(i): SimpleNamespace(num_computed_tokens=100, num_prompt_tokens=64) for i in range(streams)
    }
    output = SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(requests, 1), total_num_scheduled_tokens=streams
    )

    class Stub:
        def __init__(self) -> None:
            self.requests, self.running = requests, list(requests.values())
            self.max_num_scheduled_tokens = 2048
            self.scheduler_config = SimpleNamespace(max_num_batched_tokens=2048)

        def schedule(self) -> Any:
            return output

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            return None

    class Metered(_LiveKnobsMixin, Stub):  # type: ignore[misc]
        pass

    def per_step(scheduler: Any) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            scheduler.update_from_output(scheduler.schedule(), None)
        return (time.perf_counter() - start) / steps * 1e6

    stub, metered = Stub(), Metered()
    both = [(per_step(stub), per_step(metered)) for _ in range(rounds)]
    return {
        "vllm_stub_us": statistics.median(b[0] for b in both),
        "subclass_us": statistics.median(b[1] - b[0] for b in both),
    }


def report(stacks: dict[str, float], step: dict[str, float], streams: int, outputs: int) -> str:
    """Each stack's CPU per request and what its layer adds (markdown), then the per-step figures."""
    lines = [
        f"{streams} streams x {outputs} outputs, process CPU per request (median over rounds)",
        "",
        "| stack | us / request | its layer adds | us / output |",
        "| --- | ---: | ---: | ---: |",
    ]
    before = None
    for stack in STACKS:
        added = "-" if before is None else f"{stacks[stack] - stacks[before]:.1f}"
        lines.append(f"| {stack} | {stacks[stack]:.1f} | {added} | {stacks[stack] / outputs:.2f} |")
        before = stack
    subclass, stub = step["subclass_us"], step["vllm_stub_us"]
    lines += ["", f"scheduler subclass, per step with {streams} decoding requests: {subclass:.1f} us"]
    lines[-1] += f" (vLLM's calls stubbed: {stub:.2f} us)"
    return "\n".join(lines)
