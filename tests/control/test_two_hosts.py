"""P and D on two hosts: engine processes in two network namespaces joined by a veth pair.

Each engine binds its side channel to its own namespace's address and its transport announces
that address, so every byte has to cross the veth: 127.0.0.1 in D's namespace is not P. The veth
counters show that the moved bytes did cross it (network namespaces share one kernel, so a
same-host path such as cross-memory attach would still work between them: cma is left out, and
NIXL is given ``UCX_TLS=tcp`` because UCX otherwise sees one node and reads through CMA).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbridge.core.registry import load_transport_class
from tests.control.conftest import USABLE
from tests.control.engine import BlockAllocator, EngineProcess, run_requests
from tests.netns import Host, NamespacesUnavailable, leftovers, two_hosts

pytestmark = pytest.mark.timeout(90)

#: transports that cross hosts (cma is same-host by design, though namespaces would let it work)
NETWORK = [t for t in USABLE if t != "cma"]
TIMEOUT = 8.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    with contextlib.ExitStack() as stack:
        try:
            pair = stack.enter_context(two_hosts())
        except NamespacesUnavailable as err:
            pytest.skip(str(err))
        yield pair
    assert leftovers() == [], "network namespaces left behind"


def options(transport: str, host: Host, timeout: float = TIMEOUT, **extra: Any) -> dict[str, Any]:
    """The transport's options on ``host``: the address it announces, where it has one."""
    opts: dict[str, Any] = {"timeout": timeout}
    announce = load_transport_class(transport).host_option
    if announce is not None:  # Mooncake's ``hostname``, as the vLLM connector sets it
        opts[announce] = host.address
    if transport == "nixl":
        # UCX finds the veth by itself, but sees both namespaces as one node and would read
        # through CMA: TCP only, so the bytes take the network as between two hosts.
        opts["ucx"] = {"TLS": "tcp"}
    return {**opts, **extra}


Engines = Callable[..., EngineProcess]


def start(
    engines: Engines, host: Host, role: str, transport: str, seed: int, **opts: Any
) -> EngineProcess:
    """An engine in ``host``'s namespace, its side channel bound to ``host``'s address."""
    engine = engines(
        role,
        transport,
        netns=host.netns,
        host=host.address,
        seed=seed,
        num_blocks=1024,
        # A side channel other hosts reach needs a secret (or insecure: true).
        secret="two hosts, one secret",
        options=options(transport, host, **opts),
    )
    assert engine.info["endpoint"].startswith(f"tcp://{host.address}:"), engine.info
    assert engine.info["pid"] == engine.proc.pid  # `ip netns exec` ran it in place: reapable
    return engine


@pytest.mark.parametrize("transport", NETWORK)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_requests_cross_from_one_host_to_the_other(
    engines: Engines, hosts: tuple[Host, Host], transport: str, mode: str
) -> None:
    p_host, d_host = hosts
    p = start(engines, p_host, "prefill", transport, seed=61)
    d = start(engines, d_host, "decode", transport, seed=62)
    for engine, host in ((p, p_host), (d, d_host)):
        described = engine.call(cmd="transport")
        assert described["name"] == transport
        if transport == "mooncake":  # the session peers dial is this host's address
            assert described["session"].startswith(f"{host.address}:"), described
    p_before, d_before = p_host.counters(), d_host.counters()

    # Requests of mixed sizes, published on P, then loaded on D all at once.
    rng = random.Random(13)
    p_alloc, d_alloc = BlockAllocator(p.layout, 14), BlockAllocator(d.layout, 15)
    pairs = run_requests(p, d, 12, mode, rng, p_alloc, d_alloc)

    # Every byte of D's cache: the requests' blocks hold P's bytes, the rest is untouched.
    verified = d.call(cmd="verify", timeout=120, sources=[{"config": p.config, "pairs": pairs}])
    assert verified["ok"], verified
    moved = 0
    for p_ids, d_ids in pairs:
        checked = d.call(cmd="check", source=p.config, p_ids=p_ids, d_ids=d_ids)
        assert checked["ok"], checked
        moved += checked["bytes"]

    # P sent the blocks (read by D, or written by P) through the veth, and D received them.
    (_, p_sent), (d_received, _) = p_host.counters(), d_host.counters()
    assert p_sent - p_before[1] >= moved, (p_sent - p_before[1], moved)
    assert d_received - d_before[0] >= moved, (d_received - d_before[0], moved)


@pytest.mark.skipif("mooncake" not in USABLE, reason="mooncake is not installed")
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_mooncake_announcing_loopback_fails_cleanly(
    engines: Engines, hosts: tuple[Host, Host], mode: str
) -> None:
    # The old default: the agent that is read from (P on a pull, D on a push) announces
    # 127.0.0.1, which from the other namespace is nobody. The load fails, with the reason,
    # well within the timeout: no hang, no wrong byte.
    p_host, d_host = hosts
    loopback = "p" if mode == "pull" else "d"
    p = start(
        engines,
        p_host,
        "prefill",
        "mooncake",
        seed=71,
        timeout=4,
        **({"hostname": "127.0.0.1"} if loopback == "p" else {}),
    )
    d = start(
        engines,
        d_host,
        "decode",
        "mooncake",
        seed=72,
        timeout=4,
        **({"hostname": "127.0.0.1"} if loopback == "d" else {}),
    )
    assert (p if loopback == "p" else d).call(cmd="transport")["session"].startswith("127.0.0.1:")
    p_ids, d_ids = (
        BlockAllocator(p.layout, 1).request(200),
        BlockAllocator(d.layout, 2).request(200),
    )
    params = p.call(cmd="publish", request_id="lo", block_ids=p_ids, num_tokens=200, mode=mode)
    began = time.monotonic()
    assert d.call(cmd=mode, params=params, block_ids=d_ids) == {"started": True}
    out = d.call(cmd="wait", request_id="lo", timeout=30)
    took = time.monotonic() - began
    assert "error" not in out, out  # an outcome came, not a timeout of the wait itself
    assert not out["ok"] and "127.0.0.1" in out["reason"], out
    assert took < 15, took
    assert d.call(cmd="check", source=p.config, p_ids=p_ids, d_ids=d_ids)["ok"] is False
