"""Give the heap a retired engine freed back to the operating system.

A rebuild frees a whole engine in the daemon process: its EngineCore client, its renderer and the
renderer's tokenizer with its pool of deep copies (``vllm.tokenizers.hf.maybe_make_thread_pool``).
glibc keeps freed pages inside its arenas (each build runs in a thread of its own, and a thread's
allocations come from an arena of its own), so the pages stay resident though nothing uses them: the
daemon's RSS rose at each rebuild by about one tokenizer's worth (2-3 MiB on the tiny model, about 78
MiB on SmolLM2) while the count of live Python objects stayed flat. ``malloc_trim(0)`` returns the
free pages of every arena; with it the rise stops (docs/results/chaos.md has the rebuild loop's
figures). It is only a mitigation of fragmentation: a real leak would still show.

The trim returns only whole free pages; a page that still holds one live chunk stays, and with a new
arena for each build thread (glibc makes up to eight per core) the next build allocates in a fresh
arena instead of the freed space of the last. ``cap_malloc_arenas`` holds the daemon to a few arenas
at start, as ``MALLOC_ARENA_MAX`` does for a process started with it, so a rebuild reuses the space
the retired engine freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil

TRIMMED = "trimmed"
"""``malloc_trim`` ran (whether it found pages to return is in the RSS figures)."""
NO_MALLOC_TRIM = "no_malloc_trim"
"""The C library has no ``malloc_trim`` (not glibc: musl, macOS): nothing to call."""


@dataclass(frozen=True)
class HeapTrim:
    """What one trim did; RSS read with psutil, in bytes, of this process only (not its children)."""

    reason: str
    """``TRIMMED`` or ``NO_MALLOC_TRIM``."""
    rss_before: int
    """After the garbage collection, before the trim."""
    rss_after: int


def glibc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


GLIBC_MALLOC_TRIM = glibc_malloc_trim()

M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter number for the arena limit (``malloc.h``)."""
DAEMON_ARENAS = 2
"""Arenas the daemon keeps: its threads allocate under the GIL or in short native calls (the
tokenizer), so a second arena is enough to keep a native thread from waiting on the main one."""
ARENAS_CAPPED = "arenas_capped"
ARENAS_FROM_ENV = "arenas_from_env"
"""``MALLOC_ARENA_MAX`` was set: glibc read it at start, the operator's setting stands."""
NO_MALLOPT = "no_mallopt"
"""The C library has no ``mallopt`` (not glibc): nothing to call."""
MALLOPT_REFUSED = "mallopt_refused"


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def cap_malloc_arenas(
    arenas: int = DAEMON_ARENAS,
    mallopt: Callable[[int, int], int] | None = None,
    env: Mapping[str, str] = os.environ,
) -> str:
    """Limit glibc to ``arenas`` malloc arenas; call at start, before threads allocate (an arena
    made already stays). Returns why it did or did not (one of the constants above)."""
    if "MALLOC_ARENA_MAX" in env:
        return ARENAS_FROM_ENV
    mallopt = mallopt if mallopt is not None else glibc_mallopt()
    if mallopt is None:
        return NO_MALLOPT
    return ARENAS_CAPPED if mallopt(M_ARENA_MAX, arenas) == 1 else MALLOPT_REFUSED


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def trim_heap(
    malloc_trim: Callable[[int], int] | None = GLIBC_MALLOC_TRIM, rss: Callable[[], int] = _rss
) -> HeapTrim:
    """Collect garbage (a retired AsyncLLM sits in reference cycles: only the collector frees it),
    then return the free pages to the operating system. Blocks the calling thread for tens of ms."""
    gc.collect()
    before = rss()
    if malloc_trim is None:
        return HeapTrim(NO_MALLOC_TRIM, before, before)
    malloc_trim(0)
    return HeapTrim(TRIMMED, before, rss())
