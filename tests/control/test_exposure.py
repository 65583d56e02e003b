"""Weak side-channel settings are refused before anything binds or registers (issue 28)."""

from __future__ import annotations

import pytest

from kvbridge.control.exposure import WeakSettingError, is_loopback, refuse_weak_settings
from kvbridge.control.plane import ControlPlane
from kvbridge.testing import LoopbackTransport
from tests.core.layouts import Arena, hybrid_layout


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "::", "fe80::1", "p.example", ""])
def test_hosts_other_hosts_may_reach(host: str) -> None:
    assert not is_loopback(host)


def test_an_empty_secret_is_refused_as_text_and_as_bytes() -> None:
    for secret in ("", b""):
        with pytest.raises(WeakSettingError, match="the secret is empty"):
            refuse_weak_settings("127.0.0.1", [5790], secret)


def test_every_rank_port_must_fit() -> None:
    refuse_weak_settings("127.0.0.1", [65534, 65535], None)
    with pytest.raises(WeakSettingError, match=r"port \+ rank \(65534 \+ 2\) = 65536"):
        refuse_weak_settings("127.0.0.1", [65534, 65535, 65536], None)
    with pytest.raises(WeakSettingError, match="port = 70000 is outside"):
        refuse_weak_settings("127.0.0.1", [70000], None)


def test_no_secret_on_a_reachable_host_needs_insecure() -> None:
    with pytest.raises(WeakSettingError, match="reachable from other hosts but has no secret"):
        refuse_weak_settings("10.0.0.1", [5790], None)
    refuse_weak_settings("10.0.0.1", [5790], None, insecure=True)
    refuse_weak_settings("10.0.0.1", [5790], "s3cret")


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"secret": ""}, "the secret is empty"),
        ({"port": 70000}, "port = 70000 is outside"),
        ({"host": "0.0.0.0"}, "has no secret"),
    ],
)
def test_the_python_api_refuses_before_registering_or_binding(settings, words) -> None:
    transport = LoopbackTransport(timeout=5.0)
    try:
        with pytest.raises(WeakSettingError, match=words) as err:
            ControlPlane(hybrid_layout(Arena()), transport, **settings)
        assert "\n" not in str(err.value)
        assert transport.registered == []  # nothing registered, so nothing to free
    finally:
        transport.close()
