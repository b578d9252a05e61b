#!/usr/bin/env python3
"""The shape of the house, from the project root.

``python3 tools/house.py`` (``make house``) prints the import circles among the modules of
controller/ and policies/ (imports inside functions count too), the largest modules (a prompt to read
them for cohesion, not a limit) and the ``# fmt: skip`` lines in production code.

``python3 tools/house.py --check`` (in ``make lint``) fails on an import between rooms that
ARCHITECTURE.md's table "Who may import whom" does not allow, and on any import circle: the map is
data the code is checked against, so it cannot drift. A room is a folder of controller/ (``engine/``
and ``bench/`` by their subfolders), a top-level module of controller/, or ``policies``; imports
inside a room are free."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

PACKAGES = ("controller", "policies")
TABLE_HEADING = "## Who may import whom"
SPLIT_ROOMS = ("engine", "bench")
"""Rooms of controller/ whose subfolders are rooms of their own."""


def modules(root: Path) -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (root / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def _resolve(mods: dict[str, Path], cur: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    out = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = cur.split(".")
            is_pkg = mods.get(cur, Path()).name == "__init__.py"
            parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
            base = ".".join(parts + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    for n in names:
        while n and n not in mods:
            n = n.rpartition(".")[0]
        if n and n != cur:
            out.append(n)
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a package's own ``__init__`` left out)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[m].update(
                    t
                    for t in _resolve(mods, node=node, cur=m)
                    if not (m.startswith(t + ".") and mods[t].name == "__init__.py")
                )
    return graph


def room(mods: dict[str, Path], module: str) -> str:
    """The room a module lives in, as the table names it (``controller/engine/runtime``)."""
    parts = module.split(".")
    if parts[0] != "controller":
        return parts[0]
    if len(parts) == 1:
        return "controller"
    if parts[1] in ("cli", "__main__"):
        return "controller/cli"
    if mods[".".join(parts[:2])].name != "__init__.py":
        return f"controller/{parts[1]}"  # a top-level module
    if parts[1] in SPLIT_ROOMS and len(parts) > 2 and mods[".".join(parts[:3])].name == "__init__.py":
        return "/".join(parts[:3])
    return "/".join(parts[:2])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def allowed(architecture: str) -> dict[str, set[str]]:
    """The table under ``TABLE_HEADING``: each row a room (in backticks) and the rooms it may import
    (in backticks, "nothing" for none)."""
    _, found, rest = architecture.partition(TABLE_HEADING)
    if not found:
        raise SystemExit(f"ARCHITECTURE.md has no section {TABLE_HEADING!r}: the map's table is missing")
    table: dict[str, set[str]] = {}
    for line in rest.split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        table[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return table


def violations(mods: dict[str, Path], graph: dict[str, set[str]], table: dict[str, set[str]]) -> list[str]:
    """Each import across rooms that the table does not allow, and each room it does not name."""
    out = []
    rooms = {room(mods, m) for m in mods}
    out += [f"room {r} is not in the table: add its row" for r in sorted(rooms - set(table))]
    for m in sorted(graph):
        here = room(mods, m)
        for t in sorted(graph[m]):
            there = room(mods, t)
            if here != there and here in table and there not in table[here]:
                out.append(f"{mods[m]}: imports {t}, but {here} may not import {there}")
    return out


def check(root: Path) -> int:
    mods = modules(root)
    graph = import_graph(mods)
    problems = violations(mods, graph, allowed((root / "ARCHITECTURE.md").read_text()))
    problems += [f"import circle: {' <-> '.join(c)}" for c in circles(graph)]
    for p in problems:
        print(p.replace(str(root) + "/", ""), file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} against ARCHITECTURE.md's {TABLE_HEADING!r}: move the code, or change the "
            "table where the map itself changed",
            file=sys.stderr,
        )
        return 1
    print(f"the imports of {len(mods)} modules follow ARCHITECTURE.md's table; no import circles")
    return 0


def shape(root: Path) -> int:
    mods = modules(root)
    found = circles(import_graph(mods))
    long = sorted(
        ((len(f.read_text().splitlines()), str(f.relative_to(root))) for f in mods.values()), reverse=True
    )
    print(f"import circles: {len(found)}" + "".join(f"\n  - {' <-> '.join(c)}" for c in found))
    print(
        "largest modules (read them for one reason to change; no line count is a target):"
        + "".join(f"\n  - {p} {n}" for n, p in long[:5])
    )
    skips = sum(f.read_text().count("# fmt: skip") for f in mods.values())
    print(f"`# fmt: skip` in controller/ and policies/: {skips}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail on an import the map's table does not allow")
    args = ap.parse_args()
    root = Path.cwd()
    return check(root) if args.check else shape(root)


if __name__ == "__main__":
    sys.exit(main())
