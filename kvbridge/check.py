"""``kvbridge check``: a deployment preflight against a running engine's side channel.

From a decode host (or a prefill host), in a few seconds, one check after the other, stopping at
the first failure with what to fix:

1. ``reachable``: a TCP connection to the peer's side channel (refused and timed out told apart);
2. ``secret``: the challenge-response (a wrong secret, or one set on one side only);
3. ``versions``: the protocol version (a peer of another one is refused with both named) and the
   kvbridge release of each side (``Describe``/``About``);
4. ``layouts``: the peer's layout against the layout of this host's engine (``--local``), through
   the core's own compatibility check and planner (``check_compatible``, ``plan_tp_pair``);
5. ``data path``: a few KiB through the peer's transport both ways, between a scratch buffer of
   this process and the probe scratch the peer's plane registered for it (``Probe``): never the
   KV cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kvbridge.control.channel import PeerClient
from kvbridge.control.messages import (
    MAX_PROBE_BYTES,
    PROTOCOL_VERSION,
    About,
    Describe,
    Message,
    Probe,
    ProbeConnect,
    ProbeResult,
    ProbeScratch,
)
from kvbridge.control.plane import default_engine_id
from kvbridge.control.probes import kvbridge_version
from kvbridge.core.batches import TransferOp
from kvbridge.core.compat import check_compatible
from kvbridge.core.errors import (
    ControlError,
    KvbridgeError,
    LayoutMismatchError,
    PeerError,
    PeerRefusedError,
    PeerTimeoutError,
)
from kvbridge.core.layout import Layout
from kvbridge.core.memory import MemoryRange
from kvbridge.core.registry import load_transport, load_transport_class
from kvbridge.core.tp import contact_ranks, plan_tp_pair
from kvbridge.core.transport import Transport

ENV_SECRET = "KVBRIDGE_SECRET"
ENV_SECRET_FILE = "KVBRIDGE_SECRET_FILE"
ROLES = ("decode", "prefill")
NAMES = ("reachable", "secret", "versions", "layouts", "data path")


@dataclass
class CheckConfig:
    """What ``run_check`` checks: the peer's side channel and how to reach and prove to it."""

    peer: str
    secret: bytes | None = None
    #: this host's own engine's side channel, whose layout the peer's is checked against
    local: str | None = None
    #: this host's role; the peer has the other one
    role: str = "decode"
    #: seconds for each step (a TCP connect, one side-channel call, one transfer)
    timeout: float = 5.0
    #: options of this process's transport, as the engine's (``KVB_TRANSPORT_OPTIONS``)
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    #: the address this host's transport announces (default: the one that reached the peer)
    host: str | None = None
    probe_bytes: int = 4096


@dataclass
class Check:
    """One check's result: ``ok`` True (passed), False (failed: ``fix`` says what to do) or
    None (not done: ``detail`` says why)."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""
    seconds: float = 0.0


class CheckFailed(Exception):
    def __init__(self, check: Check) -> None:
        super().__init__(check.detail)
        self.check = check


def _fail(name: str, detail: str, fix: str) -> CheckFailed:
    return CheckFailed(Check(name, False, detail, fix))


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (or ``host:port``; IPv6 in brackets) as (host, port)."""
    text = address if "://" in address else f"tcp://{address}"
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path:
        raise ValueError(f"not a side-channel address: {address!r} (want tcp://host:port)")
    return parts.hostname, port


def _address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def read_secret(path: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The secret from ``path``, else ``KVBRIDGE_SECRET_FILE`` or ``KVBRIDGE_SECRET``; ``None``
    when none is given. A file loses its trailing newline; an empty secret is refused; errors
    name the file, never the secret."""
    origin = "--secret-file"
    if path is None:
        env_secret, env_path = environ.get(ENV_SECRET), environ.get(ENV_SECRET_FILE)
        if env_secret is not None and env_path is not None:
            raise ValueError(f"{ENV_SECRET} and {ENV_SECRET_FILE} are both set: set one")
        if env_secret is not None:
            if not env_secret.strip():
                raise ValueError(f"{ENV_SECRET} is set but empty; unset it or give a secret")
            return env_secret.encode()
        if env_path is None:
            return None
        path, origin = env_path, ENV_SECRET_FILE
    try:
        text = open(path, "rb").read().decode().rstrip("\r\n")  # noqa: SIM115
    except OSError as err:
        raise ValueError(f"{origin} {path!r}: cannot read it ({err.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{origin} {path!r}: the file is not UTF-8 text") from None
    if not text:
        raise ValueError(f"{origin} {path!r}: the file is empty")
    return text.encode()


def _summary(layout: Layout, transport: str) -> str:
    spec = layout.spec
    kinds = ", ".join(sorted({g.kind.value for g in layout.groups.values()}))
    fmt = f", block format {spec.block_format!r}" if spec.block_format else ""
    return (
        f"{len(layout.groups)} groups ({kinds}), {len(spec.tensors)} tensors, {spec.dtype}, "
        f"TP rank {spec.tp_rank} of {spec.tp_size}{fmt}, transport {transport}"
    )


def _one_block(layout: Layout) -> dict[int, list[int]]:
    """A one-block request's ids: a block of its own for each group (groups of a hybrid model
    share one pool, as vLLM's allocator hands them out; 0 may be a null placeholder)."""
    groups = sorted(layout.groups.items())
    return {i: [min(k + 1, g.num_blocks - 1)] for k, (i, g) in enumerate(groups)}


class _Checker:
    """The steps, in order; each returns its ``Check`` or raises ``CheckFailed``."""

    def __init__(self, config: CheckConfig) -> None:
        self.config = config
        self.peer_role = "prefill" if config.role == "decode" else "decode"
        self.host, self.port = parse_address(config.peer)
        self.address = _address(self.host, self.port)
        self.engine_id = f"kvbridge-check-{default_engine_id()}"
        self.local_ip = ""
        self.client: PeerClient | None = None
        self.about: About | None = None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def _ask(self, client: PeerClient, body: Message) -> Message:
        return client.request(body, self.config.timeout)

    def reachable(self) -> Check:
        timeout = self.config.timeout
        where = f"{self.host}:{self.port}"
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except ConnectionRefusedError:
            raise _fail(
                "reachable",
                f"{where} refused the connection: nothing listens there",
                f"start the {self.peer_role} engine, or fix the address (TP rank r listens on "
                "KVBRIDGE_PORT + r)",
            ) from None
        except socket.gaierror as err:
            raise _fail(
                "reachable", f"cannot resolve {self.host!r}: {err.strerror}", "fix the host name"
            ) from None
        except TimeoutError:
            raise _fail(
                "reachable",
                f"no answer from {where} within {timeout:g} s (host down, a firewall drops the "
                "packets, or a wrong address)",
                f"check that {self.host} is up and port {self.port} is open from this host",
            ) from None
        except OSError as err:
            raise _fail(
                "reachable",
                f"cannot connect to {where}: {err.strerror or err}",
                "check the route and the address",
            ) from None
        with sock:
            self.local_ip = str(sock.getsockname()[0])
        return Check(
            "reachable", True, f"{self.address} accepts connections (from {self.local_ip})"
        )

    def secret(self) -> Check:
        config = self.config
        self.client = PeerClient(
            self.address, self.engine_id, secret=config.secret, timeout=config.timeout
        )
        try:
            reply = self._ask(self.client, Describe())
        except ControlError as err:
            if err.code == "auth_failed":
                raise _fail(
                    "secret",
                    str(err),
                    f"give this check the {self.peer_role} engine's secret (--secret-file, "
                    f"{ENV_SECRET_FILE} or {ENV_SECRET}), and set the same one on every engine",
                ) from None
            if err.code == "version":
                raise _fail(
                    "versions",
                    str(err),
                    "run the same kvbridge release here and on the peer",
                ) from None
            if self.client.remote_engine_id is not None:  # authenticated, but no ``describe``
                raise _fail(
                    "versions",
                    f"the engine at {self.address} does not answer describe ({err}): its "
                    "kvbridge is older than `kvbridge check`",
                    f"upgrade kvbridge on the {self.peer_role} host to this release "
                    f"({kvbridge_version()})",
                ) from None
            raise _fail("secret", str(err), "see the peer engine's log") from None
        except PeerRefusedError:
            # The TCP connection of ``reachable`` succeeded: what listens drops the side
            # channel's greeting (an HTTP server does), or the engine stopped since.
            raise _fail(
                "secret",
                f"{self.host}:{self.port} accepts TCP connections but closed the kvbridge side "
                "channel's: another service listens there (an HTTP port, such as vLLM's API "
                "server, or a proxy), or the engine stopped a moment ago",
                f"point the check at the {self.peer_role} engine's side channel (KVBRIDGE_PORT "
                "+ TP rank), not its HTTP port, and check that the engine is up",
            ) from None
        except PeerTimeoutError as err:
            raise _fail(
                "secret",
                f"{err}; the TCP port is open but no kvbridge side channel answered",
                "check that the address is the engine's side channel (KVBRIDGE_PORT + TP rank), "
                "not another service, and that the engine is not frozen",
            ) from None
        if not isinstance(reply, About):
            raise _fail("versions", f"answered describe with {reply!r}", "upgrade kvbridge")
        self.about = reply
        engine = reply.handshake.engine_id
        if config.secret is None:
            detail = (
                f"engine {engine}: no secret on either side (anyone who reaches the port can "
                "read the KV cache)"
            )
        else:
            detail = f"engine {engine}: challenge-response passed"
        return Check("secret", True, detail)

    def versions(self) -> Check:
        about = self.about
        assert about is not None
        if about.protocol_version != PROTOCOL_VERSION:  # cannot decode otherwise, but say it
            raise _fail(
                "versions",
                f"the peer speaks protocol {about.protocol_version}, this side {PROTOCOL_VERSION}",
                "run the same kvbridge release on both sides",
            )
        ours, theirs = kvbridge_version(), about.kvbridge_version
        if ours == theirs:
            return Check("versions", True, f"protocol {PROTOCOL_VERSION}, kvbridge {ours} on both")
        return Check(
            "versions",
            True,
            f"protocol {PROTOCOL_VERSION} on both; kvbridge {theirs} there, {ours} here "
            "(compatible, but one release on both sides is safest)",
        )

    def layouts(self) -> Check:
        about = self.about
        assert about is not None
        try:
            peer = Layout(about.handshake.layout)
        except KvbridgeError as err:
            raise _fail("layouts", f"the peer's layout is invalid: {err}", "see its log") from None
        summary = f"{self.peer_role}: {_summary(peer, about.handshake.transport)}"
        if self.config.local is None:
            return Check(
                "layouts",
                None,
                f"{summary}; not checked against this host's engine (give --local "
                "tcp://host:port of its side channel)",
            )
        local_about = self._describe_local()
        local = Layout(local_about.handshake.layout)
        if local_about.handshake.transport != about.handshake.transport:
            raise _fail(
                "layouts",
                f"the {self.peer_role} uses transport {about.handshake.transport!r}, this host's "
                f"engine {local_about.handshake.transport!r}",
                "configure the same transport on both sides (KVB_TRANSPORT)",
            )
        p, d = (peer, local) if self.config.role == "decode" else (local, peer)
        try:
            check_compatible(p, d, ("prefill", "decode"))
            plan = plan_tp_pair(p, d, _one_block(p), _one_block(d))
        except LayoutMismatchError as err:
            raise _fail(
                "layouts",
                str(err),
                "serve the same model with the same dtype, cache layout and block format on "
                "both sides",
            ) from None
        except KvbridgeError as err:
            raise _fail("layouts", f"no request can be planned: {err}", "see the message") from None
        ps, ds = p.spec, d.spec
        ranks = f"prefill TP {ps.tp_rank}/{ps.tp_size} -> decode TP {ds.tp_rank}/{ds.tp_size}"
        if plan is None:
            wanted = contact_ranks(ds.tp_rank, ds.tp_size, ps.tp_size)
            raise _fail(
                "layouts",
                f"{ranks}: these two ranks exchange nothing (decode rank {ds.tp_rank} reads "
                f"from prefill ranks {list(wanted)})",
                "check the rank whose side channel is at KVBRIDGE_PORT + its TP rank",
            )
        return Check(
            "layouts",
            True,
            f"{ranks}: compatible; a one-block request plans to {plan.count} descriptors, "
            f"{plan.nbytes:,} bytes",
        )

    def _describe_local(self) -> About:
        local = self.config.local
        assert local is not None
        address = _address(*parse_address(local))
        client = PeerClient(address, self.engine_id, secret=self.config.secret)
        try:
            reply = self._ask(client, Describe())
        except (ControlError, PeerError) as err:
            raise _fail(
                "layouts",
                f"cannot describe this host's engine at {address}: {err}",
                "give --local the side channel of this host's running engine, with the same secret",
            ) from None
        finally:
            client.close()
        if not isinstance(reply, About):
            raise _fail("layouts", f"{address} answered describe with {reply!r}", "upgrade")
        return reply

    def data_path(self) -> Check:
        about, client, config = self.about, self.client, self.config
        assert about is not None and client is not None
        name = about.handshake.transport
        size = min(config.probe_bytes, about.probe_bytes, MAX_PROBE_BYTES)
        if size < 1:
            return Check(
                "data path",
                None,
                f"the {self.peer_role} engine serves no probe (its {name} transport took no "
                "host memory for a scratch buffer; see its log)",
            )
        fix = (
            f"the side channel works but {name} does not: open the transport's ports between the "
            "hosts, and announce an address the peer reaches (--host, KVBRIDGE_HOST)"
        )
        try:
            cls = load_transport_class(name)
            options = dict(config.transport_options)
            options.setdefault("timeout", config.timeout)
            if cls.host_option and cls.host_option not in options:
                options[cls.host_option] = config.host or self.local_ip
            transport = load_transport(name, **options)
        except KvbridgeError as err:
            raise _fail(
                "data path",
                f"cannot start the {name} transport here: {err}",
                f"install the engine of {name} here (`kvbridge transports` says how)",
            ) from None
        try:
            return self._probe(transport, client, about, size, fix)
        finally:
            transport.close()

    def _probe(
        self, transport: Transport, client: PeerClient, about: About, size: int, fix: str
    ) -> Check:
        raw = np.zeros(size + 4096, dtype=np.uint8)
        scratch = raw[(-raw.ctypes.data) % 4096 :][:size]
        addr = int(scratch.ctypes.data)
        peer = about.handshake.engine_id
        start = time.monotonic()
        try:
            transport.register([MemoryRange(addr, size)])
            there = self._ask(
                client, ProbeConnect(transport.name, transport.metadata(), addr, size)
            )
            if not isinstance(there, ProbeScratch) or there.size < size:
                raise _fail("data path", f"unexpected answer {there!r}", "upgrade kvbridge")
            transport.connect(peer, about.handshake.metadata)
            self._peer_writes_here(client, scratch, size, fix)
            self._write_there(transport, client, peer, scratch, there.addr, fix)
        except CheckFailed:
            raise
        except (KvbridgeError, AssertionError) as err:
            raise _fail("data path", f"the {transport.name} probe failed: {err}", fix) from None
        finally:
            with contextlib.suppress(KvbridgeError):
                self._ask(client, Probe("end"))
        ms = (time.monotonic() - start) * 1e3
        wide = transport.wide_listeners
        # The engine's own listeners have no authentication: say where they are wider than asked.
        exposed = f"; its engine here listens wider than asked: {', '.join(wide)}" if wide else ""
        return Check(
            "data path",
            True,
            f"{transport.name}: {size:,} B {self.peer_role} -> here and {size:,} B here -> "
            f"{self.peer_role}, byte for byte, in {ms:.1f} ms (scratch memory, not the KV "
            f"cache){exposed}",
        )

    def _peer_writes_here(
        self, client: PeerClient, scratch: np.ndarray, size: int, fix: str
    ) -> None:
        """The peer writes a fresh random pattern into our scratch; check it arrived."""
        written = self._ask(client, Probe("write", 0, size))
        assert isinstance(written, ProbeResult)
        if hashlib.sha256(scratch.tobytes()).digest() != written.digest:
            raise _fail(
                "data path",
                f"the {size:,} bytes the {self.peer_role} wrote here arrived different",
                fix,
            )

    def _write_there(
        self,
        transport: Transport,
        client: PeerClient,
        peer: str,
        scratch: np.ndarray,
        there: int,
        fix: str,
    ) -> None:
        """We write a fresh random pattern into the peer's scratch at ``there``, and it
        digests what it holds."""
        size = scratch.size
        pattern = os.urandom(size)
        scratch[:] = np.frombuffer(pattern, dtype=np.uint8)
        handle = transport.submit(
            TransferOp.WRITE,
            peer,
            np.array([scratch.ctypes.data], dtype=np.uint64),
            np.array([there], dtype=np.uint64),
            np.array([size], dtype=np.uint64),
        )
        transport.wait(handle, self.config.timeout)
        held = self._ask(client, Probe("digest", 0, size))
        assert isinstance(held, ProbeResult)
        if held.digest != hashlib.sha256(pattern).digest():
            raise _fail(
                "data path",
                f"the {size:,} bytes written into the {self.peer_role}'s scratch arrived different",
                fix,
            )


def run_check(config: CheckConfig, report: Callable[[Check], None] | None = None) -> list[Check]:
    """Run the checks in order, each result to ``report`` as it comes; stop at the first
    failure (the last result, ``ok`` False). ``ValueError`` for a bad address."""
    if config.role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {config.role!r}")
    if not config.timeout > 0:
        raise ValueError(f"timeout must be positive, got {config.timeout}")
    checker = _Checker(config)
    results: list[Check] = []
    steps = (checker.reachable, checker.secret, checker.versions, checker.layouts)
    try:
        for step in (*steps, checker.data_path):
            start = time.monotonic()
            try:
                result = step()
            except CheckFailed as failed:
                result = failed.check
            result.seconds = time.monotonic() - start
            results.append(result)
            if report is not None:
                report(result)
            if result.ok is False:
                break
    finally:
        checker.close()
    return results


def as_json(config: CheckConfig, results: list[Check], seconds: float) -> dict[str, Any]:
    failed = next((r for r in results if r.ok is False), None)
    return {
        "ok": failed is None,
        "peer": config.peer,
        "role": config.role,
        "seconds": round(seconds, 4),
        "checks": [asdict(r) for r in results],
        "fix": failed.fix if failed is not None else "",
    }
