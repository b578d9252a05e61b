#!/usr/bin/env python3
"""The shape of the house, from the project root: import circles among the modules of controller/ and
policies/ (imports inside functions count too), the largest modules (a prompt to read them for
cohesion, not a limit) and the `# fmt: skip` lines in production code.
Run it from the project root: python3 tools/house.py (or `make house`)"""

import ast
import sys
from pathlib import Path

root = Path.cwd()
pkgs = [p for p in ("controller", "policies") if (root / p).is_dir()]
mods = {}
for pkg in pkgs:
    for f in (root / pkg).rglob("*.py"):
        name = ".".join(f.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f


def resolve(cur: str, node: ast.ImportFrom | ast.Import) -> list[str]:
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


graph = {m: set() for m in mods}
for m, f in mods.items():
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            graph[m].update(
                t for t in resolve(m, node) if not (m.startswith(t + ".") and mods[t].name == "__init__.py")
            )

# Tarjan's strongly connected components
index, low, stack, on, sccs, i = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)


def visit(v):
    index[v] = low[v] = i[0]
    i[0] += 1
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
            sccs.append(sorted(comp))


for v in graph:
    if v not in index:
        visit(v)

long = sorted(
    ((len(f.read_text().splitlines()), str(f.relative_to(root))) for f in mods.values()), reverse=True
)
print(f"import circles: {len(sccs)}" + "".join(f"\n  - {' <-> '.join(c)}" for c in sccs))
print(
    "largest modules (read them for one reason to change; no line count is a target):"
    + "".join(f"\n  - {p} {n}" for n, p in long[:5])
)
skips = sum(f.read_text().count("# fmt: skip") for f in mods.values())
print(f"`# fmt: skip` in controller/ and policies/: {skips}")
