"""The core stays a pure library: no side channel, engine or serving framework comes with it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvbridge.core

CORE = Path(kvbridge.core.__file__).parent

#: Circles that are there on purpose: none (``planning`` and ``tp`` both use ``rank_slices``).
KNOWN_CIRCLES: list[list[str]] = []


def test_core_imports_no_zmq_engine_or_vllm() -> None:
    code = (
        "import sys, kvbridge.core, kvbridge.core.planning, kvbridge.core.transport\n"
        "import kvbridge.core.contract, kvbridge.core.engine_hooks, kvbridge.core.drivers\n"
        "import kvbridge.core.descriptors\n"
        "bad = [m for m in ('zmq', 'mooncake', 'nixl', 'vllm', 'torch', 'kvbridge.control')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"kvbridge.core imported {done.stdout.strip()}"


def _core_imports() -> dict[str, set[str]]:
    """Which ``kvbridge.core`` modules each one imports, anywhere in it (``TYPE_CHECKING`` blocks
    and function bodies too: a circle there is still a circle for readers and type checkers)."""
    modules = {
        "kvbridge.core" if p.stem == "__init__" else f"kvbridge.core.{p.stem}": p
        for p in sorted(CORE.glob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_core_modules_import_no_circle() -> None:
    graph = _core_imports()
    assert "kvbridge.core.transport" not in graph["kvbridge.core.lanes"]
    assert _circles(graph) == KNOWN_CIRCLES


def test_circle_scan_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
