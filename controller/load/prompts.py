"""Prompts of an exact token count, built with the served model's own tokenizer.

The tokenizer comes from a local model directory: ``--tokenizer PATH``, or the ``root`` that vLLM's
``/v1/models`` reports when that path exists on this machine. ``tokenizer.json`` is read with ``tokenizers``
(a base dependency); a directory without one falls back to ``transformers.AutoTokenizer`` when installed.

Counting uses the same special-token setting as vLLM's completions endpoint (``add_special_tokens=True``), so
the server's ``usage.prompt_tokens`` matches the requested length; the runner records the server's count.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from controller.load.sessions import within
from controller.load.workload import RequestSpec

# Common English words: single tokens in most BPE vocabularies (and in the tiny CPU model's).
_WORDS = (
    "the engine serves requests while the controller measures cache usage queue depth latency and "
    "throughput then moves the admission limit and batch cap so that operators sleep at night a "
    "policy decides and the loop applies each change with a reason every token costs memory and time "
    "people write code read books walk home eat bread drink water see light hear sound make plans"
).split()
SEGMENT_INDEX = 1 << 40
"""Where the word-stream indexes of shared segments start: above any request's index."""


class TokenizerError(RuntimeError):
    """No usable tokenizer; the message says which path was tried and how to pass one."""


class Tokenizer(Protocol):
    def encode(self, text: str, special: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class _Fast:
    tok: Any

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


@dataclass(frozen=True)
class _HF:
    tok: Any

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=special))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of the model directory ``path`` (or a ``tokenizer.json`` file)."""
    file = path if path.is_file() else path / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer as FastTokenizer

        return _Fast(FastTokenizer.from_file(str(file)))
    if not path.is_dir():
        raise TokenizerError(
            f"tokenizer {path}: no such directory; pass --tokenizer with the model's local directory"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise TokenizerError(
            f"tokenizer {path}: no tokenizer.json and transformers is not installed; pip install transformers"
        ) from exc
    return _HF(AutoTokenizer.from_pretrained(str(path)))


def tokenizer_path(explicit: Path | None, model_root: str | None) -> Path:
    """``--tokenizer`` if given, else the served model's ``root`` when it is a local directory."""
    if explicit is not None:
        return explicit
    if model_root and Path(model_root).exists():
        return Path(model_root)
    raise TokenizerError(
        f"the server reports the model root {model_root!r}, which is not a local path: "
        "pass --tokenizer with a local copy of the served model's tokenizer (its directory)"
    )


class PromptBuilder:
    """Builds prompts of exactly ``n`` tokens (as the tokenizer counts them), different per request index.

    Each prompt starts at its own offset in a seeded word stream, so prompts share no common prefix and prefix
    caching does not flatter the server, except where the workload says they share text:
    :meth:`for_spec` joins a request's shared segments (the same text wherever a segment appears) and
    its own text. Decoding and re-encoding can merge or split tokens at the edges, so
    the length is corrected a few times; :meth:`build` returns the text and its actual count.
    """

    def __init__(self, tokenizer: Tokenizer, seed: int = 0, max_rounds: int = 8) -> None:
        if max_rounds < 1:
            raise ValueError(f"max_rounds={max_rounds}: must be >= 1")
        self._tok = tokenizer
        self._rounds = max_rounds
        rng = random.Random(seed)
        self._stream = [rng.choice(_WORDS) for _ in range(4096)]
        self._cache: dict[tuple[int, int], tuple[str, int]] = {}
        self._joined: dict[tuple[int, int, tuple[tuple[int, int], ...]], tuple[str, int]] = {}

    def _words(self, index: int, count: int) -> str:
        start = (index * 7919) % len(self._stream)
        words = [self._stream[(start + i) % len(self._stream)] for i in range(count)]
        return f"{index} " + " ".join(words)

    def build(self, index: int, n: int) -> tuple[str, int]:
        """(text, token count) with the count equal to ``n`` whenever the tokenizer allows it."""
        if n < 1:
            raise ValueError(f"prompt length {n}: must be >= 1")
        key = (index, n)
        if key not in self._cache:
            self._cache[key] = self._build(index, n)
        return self._cache[key]

    def for_spec(self, spec: RequestSpec) -> tuple[str, int]:
        """(text, token count) of ``spec``'s prompt: the texts of its shared segments, one a line, then
        text of its own for the tokens past them. The count is the joined text's, which may differ
        from ``prompt_tokens`` by a token or two a segment (special tokens, merges at the joins)."""
        segments = within(spec.segments, spec.prompt_tokens)
        if not segments:
            return self.build(spec.index, spec.prompt_tokens)
        key = (spec.index, spec.prompt_tokens, segments)
        if key not in self._joined:
            parts = [self.build(SEGMENT_INDEX + seg, n)[0] for seg, n in segments]
            own = spec.prompt_tokens - sum(n for _, n in segments)
            if own > 0:
                parts.append(self.build(spec.index, own)[0])
            text = "\n".join(parts)
            self._joined[key] = (text, len(self._tok.encode(text)))
        return self._joined[key]

    def _build(self, index: int, n: int) -> tuple[str, int]:
        # Special tokens (a BOS, say) count toward the prompt but are not part of the text.
        overhead = len(self._tok.encode("the")) - len(self._tok.encode("the", special=False))
        ids = self._tok.encode(self._words(index, n + 8), special=False)[: max(1, n - overhead)]
        best: tuple[str, int] | None = None
        for _ in range(self._rounds):
            text = self._tok.decode(ids)
            count = len(self._tok.encode(text))
            if best is None or abs(count - n) < abs(best[1] - n):
                best = (text, count)
            if count == n:
                break
            if count > n:
                ids = ids[: max(1, len(ids) - (count - n))]
            else:
                extra = self._tok.encode(" " + self._words(index + 1, n - count + 4), special=False)
                ids = ids + extra[: n - count]
        assert best is not None  # max_rounds >= 1
        return best


def counter(tokenizer: Tokenizer) -> Callable[[str], int]:
    """Token count of a text (for ShareGPT lengths)."""
    return lambda text: len(tokenizer.encode(text))
