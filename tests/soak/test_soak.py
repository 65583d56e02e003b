"""The soak's short version (``make soak`` runs the long one): faults and load, no wrong byte."""

from __future__ import annotations

import pytest

import kvbridge
from tests.soak.soak import FAULTS, problems, run

USABLE = [t.name for t in kvbridge.available_transports() if t.usable]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", USABLE)
def test_short_soak(transport: str, capsys: pytest.CaptureFixture[str]) -> None:
    results = run([transport], requests=120, hogs=1, seed=3, log=lambda line: None)
    r = results[transport]
    with capsys.disabled():
        print(f"\nsoak {transport}: {r}")
    assert r["requests"] >= 120
    assert r["ok"] > 0 and r["failed"] > 0  # both outcomes happened: the faults bit
    assert set(r["faults"]) == set(FAULTS)  # every kind of fault was injected
    assert problems(results) == []
