"""The router needs no vLLM: nothing in ``kvbridge.router`` imports vLLM or the vLLM adapter
(the adapter imports the router's ``dispatch`` and ``bootstrap``, never the other way round)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvbridge.router

ROUTER = Path(kvbridge.router.__file__).parent
#: What the router must never import: vLLM (and the torch it brings) and kvbridge's adapters.
FORBIDDEN = ("vllm", "torch", "kvbridge.adapters")


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_importing_the_router_loads_no_vllm_and_no_adapter() -> None:
    code = (
        "import sys\n"
        "import kvbridge.router, kvbridge.router.proxy, kvbridge.router.arguments\n"
        "import kvbridge.router.dispatch, kvbridge.router.bootstrap\n"
        f"bad = [m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {FORBIDDEN!r})]\n"
        "print(','.join(sorted(bad)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"kvbridge.router imported {done.stdout.strip()}"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``TYPE_CHECKING`` blocks and function
    bodies too: an import made late is still a dependency)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_router_module_imports_vllm_or_an_adapter_anywhere() -> None:
    modules = sorted(ROUTER.glob("*.py"))
    assert {p.stem for p in modules} >= {"proxy", "arguments", "dispatch", "bootstrap"}
    bad = {p.name: sorted(m for m in _imports(p) if _forbidden(m)) for p in modules}
    assert {name: found for name, found in bad.items() if found} == {}


def test_the_scan_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvbridge.adapters.vllm import scheduler\n")
    assert any(_forbidden(m) for m in _imports(module))
