"""Transport discovery through entry points, with a throw-away third-party distribution."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvbridge
from kvbridge.core import (
    TransferOp,
    Transport,
    TransportNotFoundError,
    TransportUnavailableError,
)

PLUGIN = textwrap.dedent(
    '''
    """A third-party transport: copies within one process with ctypes.memmove."""
    import ctypes

    from kvbridge.core.transport import TransferOp, Transport, TransportLimits


    class MemmoveTransport(Transport):
        """Every engine hook; the base does the rest (peers, checks, handles, deadlines)."""

        name = "memmove"
        install_hint = "pip install 'thirdparty-transport[fancy]'"

        def __init__(self, *, timeout=5.0, label="x"):
            super().__init__(timeout=timeout)
            self.label = label
            self._open(TransportLimits())

        def _register_group(self, device, ranges):
            pass

        def _deregister_group(self, device, ranges):
            pass

        def _engine_metadata(self):
            return self.label.encode()

        def _connect_engine(self, peer, payload, old):
            return payload.decode()

        def _start_chunk(self, state, chunk):
            pairs = zip(chunk.local.tolist(), chunk.remote.tolist(), chunk.lengths.tolist())
            for l, r, n in pairs:
                src, dst = (r, l) if chunk.op is TransferOp.READ else (l, r)
                ctypes.memmove(dst, src, n)
            return None  # finished inside the call


    class NeedsEngineTransport(MemmoveTransport):
        name = "needs-engine"

        @classmethod
        def _import_engine(cls):
            import fancy_engine  # not installed

            return fancy_engine
    '''
)

ENTRY_POINTS = textwrap.dedent(
    """
    [kvbridge.transports]
    memmove = thirdparty_transport:MemmoveTransport
    needs-engine = thirdparty_transport:NeedsEngineTransport
    unimportable = thirdparty_missing_module:Transport
    """
)


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution that exists only in a temporary directory on sys.path."""
    (tmp_path / "thirdparty_transport.py").write_text(PLUGIN)
    info = tmp_path / "thirdparty_transport-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: thirdparty-transport\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("thirdparty_transport", None)


def test_third_party_transport_is_discovered_and_moves_bytes(third_party):
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert infos["memmove"].usable
    assert infos["memmove"].package == "thirdparty-transport 0.1"

    transport = kvbridge.load_transport("memmove", label="peer-a", timeout=2.0)
    assert isinstance(transport, Transport)
    assert transport.timeout == 2.0
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    from kvbridge.core import MemoryRange

    transport.register([MemoryRange(dst.ctypes.data, dst.nbytes)])
    other = kvbridge.load_transport("memmove", label="peer-b")
    transport.connect("peer", other.metadata())
    other.close()
    local = np.array([dst.ctypes.data + 8], dtype=np.uint64)
    remote = np.array([src.ctypes.data + 16], dtype=np.uint64)
    transport.transfer(TransferOp.READ, "peer", local, remote, np.array([32], dtype=np.uint64))
    assert dst[8:40].tolist() == list(range(16, 48))
    assert dst[:8].tolist() == [0] * 8
    transport.close()


def test_missing_engine_names_the_package_to_install(third_party):
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert not infos["needs-engine"].usable
    assert "pip install 'thirdparty-transport[fancy]'" in infos["needs-engine"].reason
    with pytest.raises(TransportUnavailableError, match="fancy_engine"):
        kvbridge.load_transport("needs-engine")


def test_unimportable_plugin_is_reported_not_fatal(third_party):
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert not infos["unimportable"].usable
    assert "thirdparty_missing_module" in infos["unimportable"].reason
    with pytest.raises(TransportUnavailableError, match="cannot be imported"):
        kvbridge.load_transport("unimportable")


def test_unknown_name_lists_the_installed_transports(third_party):
    with pytest.raises(TransportNotFoundError) as err:
        kvbridge.load_transport("carrier-pigeon")
    message = str(err.value)
    assert "'carrier-pigeon'" in message
    assert "memmove" in message and "needs-engine" in message


def test_without_the_distribution_the_name_is_unknown():
    with pytest.raises(TransportNotFoundError):
        kvbridge.load_transport("memmove")
