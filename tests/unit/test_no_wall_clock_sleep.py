"""No unit test waits on the wall clock (STYLE.md 5 and 15): a unit test moves a fake clock, gives an
injected sleep its tick, or waits for a condition; ``sleep(0)`` to let the loop turn is fine. A fixed
sleep makes a test slow on a quiet box and flaky on a loaded one."""

from __future__ import annotations

import ast
from pathlib import Path

UNIT_TESTS = Path(__file__).resolve().parent
SLEEP_MODULES = {"time", "asyncio"}


def sleeps_on_the_wall_clock(source: str) -> list[int]:
    """The lines of ``time.sleep``/``asyncio.sleep`` calls (however imported) whose argument is not
    the constant 0."""
    tree = ast.parse(source)
    modules = set(SLEEP_MODULES)  # names bound to the time and asyncio modules
    functions: set[str] = set()  # names bound to their sleep functions
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name in SLEEP_MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module in SLEEP_MODULES:
            functions |= {a.asname or a.name for a in node.names if a.name == "sleep"}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        is_sleep = (isinstance(f, ast.Name) and f.id in functions) or (
            isinstance(f, ast.Attribute)
            and f.attr == "sleep"
            and isinstance(f.value, ast.Name)
            and f.value.id in modules
        )
        arg = node.args[0] if node.args else None
        if is_sleep and not (isinstance(arg, ast.Constant) and arg.value == 0):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_unit_test_sleeps_on_the_wall_clock() -> None:
    found = {
        path.name: lines
        for path in sorted(UNIT_TESTS.glob("*.py"))
        if (lines := sleeps_on_the_wall_clock(path.read_text()))
    }
    assert found == {}


def test_the_scan_finds_each_way_of_sleeping_and_lets_a_loop_turn_pass() -> None:
    source = """
import asyncio
import time as t
from asyncio import sleep as nap

async def f(fake_sleep):
    await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    t.sleep(1)
    await nap(2)
    await asyncio.sleep(delay)
    await fake_sleep(5)
"""
    assert sleeps_on_the_wall_clock(source) == [8, 9, 10, 11]
