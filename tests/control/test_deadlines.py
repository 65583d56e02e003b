"""The plane's time bounds, derived once from its three settings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbridge.control.deadlines import Deadlines


def test_every_bound_derives_from_the_three_settings() -> None:
    d = Deadlines(timeout=4.0, lease=10.0, handshake_timeout=3.0)
    assert (d.call, d.publish_wait, d.connect, d.fence_round) == (4.0, 4.0, 4.0, 4.0)
    assert (d.slow_after, d.read_hold, d.load, d.remember) == (1.0, 8.0, 11.0, 10.0)
    assert d.retry_pause == 1.0 and Deadlines(0.5, 1.0).retry_pause == 0.5
    assert d.handshake_attempt(10.0) == 4.0 and d.handshake_attempt(2.0) == 2.0
    assert d.handshake_attempt(-1.0) == 0.1
    assert replace(d, timeout=1.0).read_hold == 2.0  # a changed setting derives them again


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": 0}, "timeout must be positive"),
        ({"lease": -1}, "lease must be positive"),
        ({"handshake_timeout": 0}, "handshake_timeout must be positive"),
        ({"timeout": 10, "lease": 15}, "at least twice the timeout"),
    ],
)
def test_bounds_that_cannot_hold_together_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Deadlines(**kwargs)
