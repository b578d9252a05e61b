"""An engine rebuild leaves nothing of the retired engine's renderer in the daemon process.

Found in the chaos soak (docs/benchmarks.md section 9): the daemon's RSS rose ~3 MiB at each rebuild
(tiny model). vLLM's renderer makes its tokenizer thread-safe by giving it a class of its own
(``maybe_make_thread_pool``: a pool of deep copies), and the app's warmup asks vLLM's ``supports_kw``
about that class's ``apply_chat_template``, which memoizes per function in a module-level
``lru_cache``: the retired renderer's tokenizer copies stayed pinned there (up to 128 entries, two per
renderer). Here the tokenizer and the memo are vLLM's own (the tiny model's tokenizer, no engine); the
engine builder is a fake; the host is real."""

from __future__ import annotations

import argparse
import copy
import gc
import weakref
from typing import Any

import pytest
from vllm.renderers.hf import resolve_chat_template_kwargs
from vllm.tokenizers.hf import maybe_make_thread_pool
from vllm.tokenizers.registry import get_tokenizer

from controller.control.steps import StepFeed
from controller.engine.runtime import host as host_module
from controller.engine.runtime.heap import NO_MALLOC_TRIM, TRIMMED, HeapTrim, trim_heap
from controller.engine.runtime.host import EngineHost
from tests.helpers import TINY_MODEL, FakeBuiltEngine, settle


def served_tokenizer() -> tuple[Any, list[weakref.ref[Any]]]:
    """A renderer's tokenizer as vLLM makes it (HfRenderer: a copy made thread-safe), used once as the
    app's warmup uses it; with weak references to it, its pool of copies and its class's methods."""
    tokenizer = maybe_make_thread_pool(copy.copy(get_tokenizer(str(TINY_MODEL))), 3)
    template = (TINY_MODEL / "chat_template.jinja").read_text()
    resolve_chat_template_kwargs(tokenizer, template, {"add_generation_prompt": True, "continue_final": 1})
    cls = type(tokenizer)
    held = [tokenizer, cls.apply_chat_template, cls.encode]
    cells = [c.cell_contents for c in cls.__reduce__.__closure__ or ()]  # (og_tokenizer, copies)
    held += [c for c in cells if hasattr(c, "encode")]
    return tokenizer, [weakref.ref(x) for x in held]


async def test_a_retired_renderers_tokenizer_is_freed_once_its_grace_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_module, "RENDERER_GRACE_S", 0.0)  # it ends on the loop's next turn
    tokenizer, refs = served_tokenizer()
    assert len(refs) == 4
    old, new = FakeBuiltEngine(tokenizer), FakeBuiltEngine()
    del tokenizer
    host = EngineHost(argparse.Namespace(max_num_seqs=4), StepFeed(), builder=lambda _args: new)
    host._llm = old  # type: ignore[assignment]
    await host.restart({"kv_cache_memory_bytes": 1 << 20})  # the crash path: old engine first
    assert host.llm is new
    del old
    await settle()  # the grace ends: the host lets the retired engine go
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


async def test_the_heap_is_trimmed_once_the_retired_engine_can_be_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trim runs after the grace, when nothing of ours holds the retired engine any more (the
    grace's timer handle held it as an argument), so the collection inside the trim frees it."""
    monkeypatch.setattr(host_module, "RENDERER_GRACE_S", 0.0)  # it ends on the loop's next turn
    old, new = FakeBuiltEngine(), FakeBuiltEngine()
    old_ref = weakref.ref(old)
    freed_at_trim: list[bool] = []

    def trim() -> HeapTrim:
        gc.collect()
        freed_at_trim.append(old_ref() is None)
        return HeapTrim(TRIMMED, 2 << 20, 1 << 20)

    host = EngineHost(
        argparse.Namespace(max_num_seqs=4), StepFeed(), builder=lambda _args: new, heap_trim=trim
    )
    host._llm = old  # type: ignore[assignment]
    del old
    await host.restart({"kv_cache_memory_bytes": 1 << 20})
    assert freed_at_trim == []  # the renderer's grace: the retired engine is still held
    await settle()  # the grace ends, then the trim runs on the turn after
    assert freed_at_trim == [True]


def test_trim_heap_collects_then_trims_and_reports_the_rss() -> None:
    readings = iter([300, 200])
    calls: list[int] = []

    def malloc_trim(pad: int) -> int:
        calls.append(pad)
        return 1

    assert trim_heap(malloc_trim, lambda: next(readings)) == HeapTrim(TRIMMED, 300, 200)
    assert calls == [0]  # 0: keep no padding at the top of the heap


def test_trim_heap_without_malloc_trim_says_so() -> None:
    assert trim_heap(None, lambda: 300) == HeapTrim(NO_MALLOC_TRIM, 300, 300)
