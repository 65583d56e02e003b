"""``kvbridge check``: the preflight against real engine processes (a real ``ControlPlane`` over a
real transport in another OS process, one per transport shared by the module's cases)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvbridge
from kvbridge.check import parse_address
from kvbridge.cli import main
from kvbridge.control import messages
from kvbridge.control.channel import PeerClient
from kvbridge.control.messages import (
    About,
    Describe,
    Probe,
    ProbeConnect,
    ProbeResult,
    ProbeScratch,
)
from kvbridge.control.probes import SCRATCH_BYTES
from kvbridge.core.batches import TransferOp
from kvbridge.core.errors import ControlError, MessageError
from kvbridge.core.layout import Layout
from kvbridge.core.memory import MemoryRange
from tests.control.engine import EngineProcess
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SECRET = "preflight-secret"
TRANSPORTS = [
    t.name for t in kvbridge.available_transports() if t.usable and t.name in ("mooncake", "nixl")
]
if not TRANSPORTS:
    pytest.skip("neither mooncake nor nixl is usable here", allow_module_level=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., EngineProcess]]:
    """Engine processes by (role, transport, config), started once for the module."""
    started: dict[str, EngineProcess] = {}
    tmp = tmp_path_factory.mktemp("check")

    def get(role: str, transport: str, **config: Any) -> EngineProcess:
        key = json.dumps([role, transport, config], sort_keys=True)
        if key not in started:
            config.setdefault("options", {"timeout": 8})
            config.setdefault("num_blocks", 64)
            started[key] = EngineProcess.start(
                tmp, f"{role}-{transport}", transport=transport, secret=SECRET, **config
            )
        return started[key]

    yield get
    for engine in started.values():
        engine.stop()


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_text(SECRET + "\n")
    return str(path)


@pytest.fixture(autouse=True)
def _no_secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVBRIDGE_SECRET", "KVBRIDGE_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["check", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"]}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_check_passes_against_a_good_peer(transport, engines, secret_file, capsys):
    peer, local = engines("prefill", transport), engines("decode", transport, seed=7)
    code, doc = check(
        capsys,
        peer.info["endpoint"],
        "--secret-file",
        secret_file,
        "--local",
        local.info["endpoint"],
    )
    checks = by_name(doc)
    assert code == 0 and doc["ok"], json.dumps(doc)
    assert list(checks) == ["reachable", "secret", "versions", "layouts", "data path"]
    assert all(c["ok"] is True for c in checks.values()), doc
    assert peer.info["engine_id"] in checks["secret"]["detail"]
    assert f"protocol {messages.PROTOCOL_VERSION}" in checks["versions"]["detail"]
    assert "compatible; a one-block request plans to" in checks["layouts"]["detail"]
    assert f"{transport}: 4,096 B prefill -> here" in checks["data path"]["detail"]
    assert "byte for byte" in checks["data path"]["detail"]
    # Mooncake's engine binds its ports on every interface: the line says so (NIXL's is bound)
    wider = "listens wider than asked" in checks["data path"]["detail"]
    assert wider == (transport == "mooncake"), checks["data path"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_probe_moves_bytes_exactly_both_ways_and_only_through_scratch(transport, engines):
    """What the data-path check does, step by step, with the bytes compared here: the peer's
    write lands byte for byte in our scratch, ours in its scratch, and its cache is untouched."""
    peer = engines("prefill", transport)
    cache_before = peer.call(cmd="digest")
    client = PeerClient(peer.info["endpoint"], "test-probe-bytes", secret=SECRET.encode())
    ours = kvbridge.load_transport(transport, timeout=8)
    size = 8192
    scratch = np.zeros(size, dtype=np.uint8)
    addr = int(scratch.ctypes.data)
    try:
        about = client.request(Describe())
        assert isinstance(about, About) and about.probe_bytes == SCRATCH_BYTES
        ours.register([MemoryRange(addr, size)])
        there = client.request(ProbeConnect(transport, ours.metadata(), addr, size))
        assert isinstance(there, ProbeScratch) and there.size == SCRATCH_BYTES
        # the probe scratch is none of the KV cache's memory
        layout = Layout(about.handshake.layout)
        assert all(
            r.end <= there.addr or there.addr + there.size <= r.addr for r in layout.registration
        )
        ours.connect(about.handshake.engine_id, about.handshake.metadata)
        written = client.request(Probe("write", 1024, 2048))
        assert isinstance(written, ProbeResult)
        assert hashlib.sha256(scratch[1024:3072].tobytes()).digest() == written.digest
        assert not scratch[:1024].any() and not scratch[3072:].any()  # nothing beyond the range
        pattern = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
        scratch[:] = pattern
        one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
        ours.transfer(
            TransferOp.WRITE,
            about.handshake.engine_id,
            one(addr),
            one(there.addr),
            one(size),
        )
        held = client.request(Probe("digest", 0, size))
        assert isinstance(held, ProbeResult)
        assert held.digest == hashlib.sha256(pattern.tobytes()).digest()
        client.request(Probe("end"))
    finally:
        client.close()
        ours.close()
    assert peer.call(cmd="digest") == cache_before


def test_a_probe_beyond_the_scratch_is_refused_and_touches_no_kv_block(engines):
    transport = TRANSPORTS[0]
    peer = engines("prefill", transport)
    cache_before = peer.call(cmd="digest")
    client = PeerClient(peer.info["endpoint"], "test-probe-bounds", secret=SECRET.encode())
    ours = kvbridge.load_transport(transport, timeout=8)
    scratch = np.zeros(4096, dtype=np.uint8)
    addr = int(scratch.ctypes.data)
    try:
        with pytest.raises(ControlError) as before:  # no probe before probe_connect
            client.request(Probe("write", 0, 16))
        assert before.value.code == "probe_unconnected"
        # the checker's "scratch" is the peer's own KV cache: refused, whichever agent it names
        about = client.request(Describe())
        assert isinstance(about, About)
        kv = Layout(about.handshake.layout).registration[0]
        ours.register([MemoryRange(addr, 4096)])
        with pytest.raises(ControlError) as overlap:
            client.request(ProbeConnect(transport, ours.metadata(), kv.addr, 4096))
        assert overlap.value.code == "probe_refused"
        assert isinstance(
            client.request(ProbeConnect(transport, ours.metadata(), addr, 4096)), ProbeScratch
        )
        for offset, length in [
            (SCRATCH_BYTES, 1),  # past the peer's scratch
            (0, SCRATCH_BYTES),  # past the checker's 4 KiB
            (4000, 200),  # straddles the end of the checker's scratch
            (0, 0),  # empty
        ]:
            for action in ("write", "digest"):
                with pytest.raises(ControlError) as refused:
                    client.request(Probe(action, offset, length))  # type: ignore[arg-type]
                assert refused.value.code == "probe_bounds", (action, offset, length)
        # the schema itself caps what a probe can name: the peer refuses to decode more
        with pytest.raises(MessageError) as capped:
            messages.decode(messages.encode(1, Probe("write", 0, messages.MAX_PROBE_BYTES + 1)))
        assert capped.value.code == "invalid"
        client.request(Probe("end"))
    finally:
        client.close()
        ours.close()
    assert not scratch.any()  # no refused probe wrote here
    assert peer.call(cmd="digest") == cache_before


def test_an_unauthenticated_peer_gets_no_probe(engines):
    peer = engines("prefill", TRANSPORTS[0])
    client = PeerClient(peer.info["endpoint"], "test-probe-noauth", secret=b"wrong")
    try:
        with pytest.raises(ControlError) as err:
            client.request(Probe("digest", 0, 16))
        assert err.value.code == "auth_failed"
    finally:
        client.close()


@pytest.mark.parametrize(
    ("secret", "message"),
    [("not-the-secret", "wrong shared secret"), (None, "requires a shared secret, none is set")],
)
def test_a_wrong_or_missing_secret_fails_at_the_secret_line(
    secret, message, engines, tmp_path, capsys
):
    peer = engines("prefill", TRANSPORTS[0])
    args = [peer.info["endpoint"]]
    if secret is not None:
        (tmp_path / "s").write_text(secret)
        args += ["--secret-file", str(tmp_path / "s")]
    assert main(["check", *args]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[1] == "reachable"
    assert lines[1].split()[1] == "secret" and message in lines[1]
    assert lines[-1].startswith("fix: give this check the prefill engine's secret")
    assert len(lines) == 3  # stopped at the first failure


def test_the_secret_comes_from_the_environment(engines, monkeypatch, capsys):
    peer = engines("prefill", TRANSPORTS[0])
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)
    code, doc = check(capsys, peer.info["endpoint"])
    assert by_name(doc)["secret"]["ok"] is True and code == 0, doc
    assert by_name(doc)["layouts"]["ok"] is None  # no --local: not done, and said so
    assert "not checked against this host's engine" in by_name(doc)["layouts"]["detail"]


def test_nothing_listening_fails_reachable(capsys):
    code, doc = check(capsys, f"tcp://127.0.0.1:{free_port()}", "--timeout", "30")
    assert code == 1 and not doc["ok"]
    assert [c["name"] for c in doc["checks"]] == ["reachable"]
    assert "refused the connection: nothing listens there" in doc["checks"][0]["detail"]
    assert doc["fix"].startswith("start the prefill engine")


def test_an_http_port_is_named_as_another_service_not_as_nothing_listening(capsys):
    """``kvbridge check`` pointed at an HTTP server (vLLM's API port): the TCP connection
    succeeds, and the server answers the side channel's greeting with 400 and closes, as
    uvicorn does; the line says so, not "nothing listens"."""
    import socketserver
    import threading

    class BadRequest(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.settimeout(5)
            self.request.recv(64)  # the side channel's greeting: no HTTP request line
            self.request.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), BadRequest)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        code, doc = check(capsys, f"tcp://127.0.0.1:{port}", "--timeout", "5")
    finally:
        server.shutdown()
        server.server_close()
    assert code == 1 and not doc["ok"]
    failed = doc["checks"][-1]
    assert doc["checks"][0]["ok"] and failed["name"] == "secret", doc
    assert "another service listens there" in failed["detail"], failed
    assert "nothing listens" not in failed["detail"]
    assert "not its HTTP port" in doc["fix"]


def test_an_incompatible_local_layout_fails_the_layouts_line(engines, secret_file, capsys):
    transport = TRANSPORTS[0]
    peer = engines("prefill", transport)
    local = engines("decode", transport, head_dim=128)
    code, doc = check(
        capsys,
        peer.info["endpoint"],
        "--secret-file",
        secret_file,
        "--local",
        local.info["endpoint"],
    )
    checks = by_name(doc)
    assert code == 1 and list(checks)[-1] == "layouts"
    assert checks["layouts"]["ok"] is False
    assert "prefill" in checks["layouts"]["detail"] and "decode" in checks["layouts"]["detail"]
    assert "data path" not in checks


def test_another_protocol_version_fails_the_versions_line(
    engines, secret_file, monkeypatch, capsys
):
    peer = engines("prefill", TRANSPORTS[0])
    ours = messages.PROTOCOL_VERSION
    monkeypatch.setattr(messages, "PROTOCOL_VERSION", ours + 1)
    code, doc = check(capsys, peer.info["endpoint"], "--secret-file", secret_file)
    last = doc["checks"][-1]
    assert code == 1 and last["name"] == "versions" and last["ok"] is False
    assert f"protocol version {ours} is not supported" in last["detail"]
    assert f"this side speaks {ours + 1}" in last["detail"]


def test_bad_arguments_exit_2_without_checking(tmp_path, capsys):
    (tmp_path / "empty").write_text("\n")
    assert main(["check", "tcp://127.0.0.1:1", "--secret-file", str(tmp_path / "empty")]) == 2
    assert "the file is empty" in capsys.readouterr().err
    assert main(["check", "http://127.0.0.1:1"]) == 2
    assert "want tcp://host:port" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no secret on the command line
        main(["check", "tcp://127.0.0.1:1", "--secret", "x"])
    assert parse_address("tcp://[::1]:5790") == ("::1", 5790)


def test_check_help_documents_the_options(capsys):
    with pytest.raises(SystemExit) as done:
        main(["check", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for option in ("--secret-file", "--local", "--role", "--timeout", "--json", "KVBRIDGE_SECRET"):
        assert option in out


def test_decode_sh_stops_when_the_prefill_check_fails(tmp_path):
    env = {
        **os.environ,
        "MODEL": "unused",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "KVB_CHECK_PREFILL": "1",
        "KVB_PREFILL_PEERS": f"127.0.0.1:{free_port()}",
    }
    env.pop("KVBRIDGE_SECRET", None)
    env.pop("KVBRIDGE_SECRET_FILE", None)
    done = subprocess.run(
        ["bash", str(ROOT / "examples/deploy/decode.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "reachable" in done.stderr and "failed the check; not starting" in done.stderr
