"""The daemon caps glibc's malloc arenas at start, unless the operator set MALLOC_ARENA_MAX."""

from __future__ import annotations

from controller.engine.runtime.heap import (
    ARENAS_CAPPED,
    ARENAS_FROM_ENV,
    M_ARENA_MAX,
    MALLOPT_REFUSED,
    NO_MALLOPT,
    cap_malloc_arenas,
    glibc_mallopt,
)


def test_the_arena_limit_is_set_through_mallopt() -> None:
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return 1

    assert cap_malloc_arenas(2, mallopt, env={}) == ARENAS_CAPPED
    assert calls == [(M_ARENA_MAX, 2)]


def test_the_operators_malloc_arena_max_stands() -> None:
    def mallopt(param: int, value: int) -> int:
        raise AssertionError("mallopt called though MALLOC_ARENA_MAX was set")

    assert cap_malloc_arenas(2, mallopt, env={"MALLOC_ARENA_MAX": "4"}) == ARENAS_FROM_ENV


def test_a_refusing_or_missing_mallopt_is_reported() -> None:
    assert cap_malloc_arenas(2, lambda _p, _v: 0, env={}) == MALLOPT_REFUSED
    if glibc_mallopt() is None:
        assert cap_malloc_arenas(2, env={}) == NO_MALLOPT
