"""The prompt length admission sees before vLLM tokenizes (``engine/frontend/prompts.py``): counted from
the raw request, passed by the ticket into the gate's check, where under SLO steering it adds the
request's own prefill to its predicted TTFT."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.admission.ttft import TtftBounds
from controller.clock import FakeClock
from controller.engine.frontend import prompts, tickets
from controller.engine.frontend.client import GateRefusal, GovernedEngineClient
from tests.helpers import TINY_MODEL, FakeHost


class WordTokenizer:
    """One token per word."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return list(range(len(text.split())))


class Broken:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError("Already borrowed")


@pytest.mark.parametrize(
    ("request_fields", "tokens"),
    [
        ({"prompt": "one two three"}, 3),
        ({"prompt": ["one two", "three four five"]}, 5),  # every prompt prefills
        ({"prompt": [5, 6, 7, 8]}, 4),  # token ids: one prompt, counted as given
        ({"prompt": [[1, 2], [3, 4, 5]]}, 5),
        ({"messages": [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d"}]}, 4),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "image_url"}]}
                ]
            },
            2,
        ),
        ({"prompt": None, "prompt_embeds": b"..."}, None),
        ({"prompt": 3}, None),  # a shape vLLM refuses with 400 anyway
    ],
)
async def test_the_prompt_is_counted_as_the_served_tokenizer_splits_it(
    request_fields: dict[str, Any], tokens: int | None
) -> None:
    assert await prompts.prompt_tokens(SimpleNamespace(**request_fields), WordTokenizer()) == tokens


async def test_without_a_tokenizer_only_token_ids_are_counted() -> None:
    assert await prompts.prompt_tokens(SimpleNamespace(prompt="some text"), None) is None
    assert await prompts.prompt_tokens(SimpleNamespace(prompt=[1, 2, 3]), None) == 3
    assert await prompts.prompt_tokens(SimpleNamespace(prompt="x"), Broken()) is None


async def test_a_long_text_is_encoded_off_the_event_loop_with_the_same_count() -> None:
    text = "word " * (prompts.LONG_TEXT // 2)
    assert (
        await prompts.prompt_tokens(SimpleNamespace(prompt=text), WordTokenizer()) == prompts.LONG_TEXT // 2
    )


async def test_the_real_tokenizer_counts_what_vllm_will_prefill() -> None:
    transformers = pytest.importorskip("transformers")
    if not TINY_MODEL.is_dir():
        pytest.skip("models/tiny is built by `make model`")
    tok = transformers.AutoTokenizer.from_pretrained(str(TINY_MODEL))
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    assert await prompts.prompt_tokens(SimpleNamespace(prompt=text), tok) == len(
        tok.encode(text, add_special_tokens=False)
    )


@dataclass
class Serving:
    """vLLM's serving shape: a renderer holding the tokenizer, _get_priority, _preflight, an entry point."""

    client: GovernedEngineClient
    renderer: Any = field(default_factory=lambda: SimpleNamespace(tokenizer=WordTokenizer()))

    @property
    def engine_client(self) -> GovernedEngineClient:
        return self.client

    @staticmethod
    def _get_priority(request: Any, raw_request: Any) -> int:
        return 0

    def _preflight(self, n: int = 1) -> None:
        self.client.check_admission(n)

    async def create_completion(self, request: Any, raw_request: Any = None) -> str:
        self._preflight()
        return "started"


def served(gate: AdmissionGate) -> Serving:
    """A serving object over the governed client of ``gate``, its entry point wrapped as the daemon does."""
    llm = SimpleNamespace(check_admission=lambda n, rid: None)
    serving = Serving(GovernedEngineClient(FakeHost(llm), gate, lambda: None))  # type: ignore[arg-type]
    assert tickets.capture_priorities(SimpleNamespace(_state={"serving": serving})) == 1
    return serving


async def complete(serving: Serving, ticket: tickets.Ticket, prompt: str) -> str:
    """One completion of ``prompt`` under ``ticket``, as the data plane's middleware gives it."""
    token = tickets.current.set(ticket)
    try:
        return await serving.create_completion(SimpleNamespace(prompt=prompt, model_fields_set=set()))
    finally:
        tickets.current.reset(token)


class SlowPrefill:
    def prefill_s(self, prompt_tokens: int) -> float:
        return 0.1 * prompt_tokens


async def test_a_long_prompt_is_refused_by_its_predicted_ttft_and_a_short_one_waits() -> None:
    """Without the count from the raw request the long prompt would queue: its wait alone (0.5 s)
    is within the 2 s bound; its own prefill (4 s) is not."""
    clock = FakeClock()
    interactive = PriorityClass("interactive", max_priority=0, max_queue=10, queue_deadline_s=30.0)
    gate = AdmissionGate(1, 100, (interactive,), clock=clock)
    for _ in range(20):  # 2 completions a second measured
        gate.release(await gate.acquire(0, from_pending=False))
        clock.advance(0.5)
    held = await gate.acquire(0, from_pending=False)  # the one slot is busy: a new request queues
    gate.set_ttft(TtftBounds({"interactive": 2.0}, SlowPrefill()))
    serving = served(gate)
    long, short = tickets.Ticket(arrived_mono=clock()), tickets.Ticket(arrived_mono=clock())
    with pytest.raises(GateRefusal) as refused:
        await complete(serving, long, "w " * 40)
    assert "expected wait 0.5s + 4.00s to its first token" in str(refused.value.message)
    assert await complete(serving, short, "w w") == "started"
    assert (long.prompt_tokens, short.prompt_tokens) == (40, 2)
    assert gate.stats().pending == 1
    gate.release(held)
    own = serving._autopilot_tokenizer  # type: ignore[attr-defined]
    assert own is not serving.renderer.tokenizer and own.calls == 2  # a copy encodes, not vLLM's own
    assert serving.renderer.tokenizer.calls == 0


def test_vllms_thread_safe_tokenizer_is_used_as_it_is() -> None:
    """vLLM wraps the served tokenizer in a pool of copies (thread-safe): counting uses it, no copy of
    the pool; any other tokenizer is copied once (test above)."""
    transformers = pytest.importorskip("transformers")
    from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin, maybe_make_thread_pool

    if not TINY_MODEL.is_dir():
        pytest.skip("models/tiny is built by `make model`")
    tok = maybe_make_thread_pool(transformers.AutoTokenizer.from_pretrained(str(TINY_MODEL)))
    assert isinstance(tok, ThreadSafeHFTokenizerMixin)
    serving = SimpleNamespace(renderer=SimpleNamespace(tokenizer=tok))
    assert tickets.tokenizer_of(serving) is tok


async def test_without_slo_steering_no_prompt_is_tokenized() -> None:
    """The prefill term is SLO steering's alone: under any other policy counting would be wasted work
    on every request's way in."""
    gate = AdmissionGate(1, 100, (PriorityClass("interactive", max_priority=0),))
    serving = served(gate)
    plain, steered = tickets.Ticket(), tickets.Ticket()
    assert await complete(serving, plain, "a b c") == "started"
    gate.set_ttft(TtftBounds({"interactive": 2.0}, SlowPrefill()))
    assert await complete(serving, steered, "a b c") == "started"
    assert (plain.prompt_tokens, steered.prompt_tokens) == (None, 3)
