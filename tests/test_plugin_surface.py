"""The public surface for transport plugins (``kvbridge.plugin``): exactly these names, each
documented, and the plugins that model it (the procmem example, ``cma``) import kvbridge from it
alone."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvbridge.plugin

ROOT = Path(__file__).resolve().parents[1]

#: What a plugin may import. Adding or removing one changes what third parties build on.
EXPORTED = [
    "CHUNK_OK",
    "AddrArray",
    "Chunk",
    "ChunkRefused",
    "ChunkResult",
    "DeviceKey",
    "MemoryAccess",
    "MemoryKind",
    "MemoryRange",
    "PeerError",
    "PeerRanges",
    "PublishedRanges",
    "RegistrationError",
    "TransferError",
    "TransferOp",
    "Transport",
    "TransportError",
    "TransportLimits",
    "TransportUnavailableError",
]


def test_the_plugin_surface_exports_exactly_its_names():
    assert kvbridge.plugin.__all__ == EXPORTED
    public = {name for name in vars(kvbridge.plugin) if not name.startswith("_")}
    # everything public in the module is exported (imports of the module's own aside)
    assert public - {"annotations"} == set(EXPORTED)


def test_every_exported_class_is_documented_where_the_surface_names_it():
    doc = kvbridge.plugin.__doc__ or ""
    for name in EXPORTED:
        value = getattr(kvbridge.plugin, name)
        assert f"``{name}``" in doc, f"{name} is exported but the module's docstring omits it"
        if inspect.isclass(value):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"


def _kvbridge_imports(path: Path) -> set[str]:
    """The kvbridge modules a source file imports from."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbridge"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvbridge")}
    return found


def test_model_plugins_import_kvbridge_only_through_the_surface():
    for path in (
        ROOT / "examples" / "procmem-transport" / "procmem_transport.py",
        ROOT / "kvbridge" / "transports" / "cma" / "transport.py",
    ):
        assert _kvbridge_imports(path) == {"kvbridge.plugin"}, path
