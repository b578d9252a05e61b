"""Locust load for any OpenAI-compatible server (ours or plain ``vllm serve``), for users who prefer locust.

    pip install locust
    MODEL=smollm2 TOKENIZER=models/smollm2 PROMPT_TOKENS=128 OUTPUT_TOKENS=128 \\
        locust -f tools/locustfile.py --host http://127.0.0.1:8000 --users 32 --spawn-rate 8

Each user sends streaming ``/v1/completions`` requests forced to ``OUTPUT_TOKENS`` (``ignore_eos``) with a
prompt of exactly ``PROMPT_TOKENS`` tokens (built with the model's tokenizer, as ``bench run`` does) and waits
``WAIT_S`` seconds between them. Locust's table shows three entries: ``headers`` (locust's own timing of a
streamed response ends at its headers), ``ttft`` (time to the first streamed token) and ``e2e`` (time to the
end of the stream; failures are counted on ``headers``). ``PRIORITY`` sets vLLM's ``priority`` field
(lower is more urgent; the server must schedule by priority). For open-loop arrivals, goodput and the
report, use ``vllm-autopilot bench run``: locust's users are a closed loop.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

from locust import HttpUser, between, task

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from controller.load.client import Target, parse_event, payload  # noqa: E402
from controller.load.prompts import PromptBuilder, load_tokenizer  # noqa: E402
from controller.load.workload import RequestSpec  # noqa: E402

MODEL = os.environ.get("MODEL", "smollm2")  # config.toml's served_model_name
PROMPT_TOKENS = int(os.environ.get("PROMPT_TOKENS", "128"))
OUTPUT_TOKENS = int(os.environ.get("OUTPUT_TOKENS", "128"))
PRIORITY = int(os.environ.get("PRIORITY", "0"))
WAIT_S = float(os.environ.get("WAIT_S", "0"))
BUILDER = PromptBuilder(load_tokenizer(Path(os.environ.get("TOKENIZER", str(ROOT / "models" / "smollm2")))))
COUNTER = itertools.count()
TARGET = Target("", MODEL)  # locust's --host is the base URL


class CompletionUser(HttpUser):
    wait_time = between(WAIT_S, WAIT_S)

    @task
    def completion(self) -> None:
        spec = RequestSpec(next(COUNTER), 0.0, PROMPT_TOKENS, OUTPUT_TOKENS, PRIORITY)
        body = payload(TARGET, spec, BUILDER.build(spec.index, PROMPT_TOKENS)[0])  # the body bench run sends
        start = time.perf_counter()
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name="headers") as resp:  # fmt: skip
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            first = None
            for line in resp.iter_lines():
                event = parse_event(line)
                if event is None:
                    continue
                if event.get("choices") and first is None:
                    first = time.perf_counter() - start
                    self._timing("ttft", first)
                usage = event.get("usage") or {}
                if usage.get("completion_tokens", OUTPUT_TOKENS) < OUTPUT_TOKENS:
                    resp.failure(f"short output: {usage}")
                    return
            if first is None:
                resp.failure("stream ended without a token")
                return
            self._timing("e2e", time.perf_counter() - start)

    def _timing(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type="POST",
            name=name,
            response_time=seconds * 1000,
            response_length=0,
            exception=None,
            context={},
        )
