"""The side-channel protocol as one table, and the push's figures on the wire (no engines)."""

from __future__ import annotations

import typing

from kvbridge.control import messages
from kvbridge.control.messages import PushDone, TransferFigures, decode, encode
from kvbridge.control.plane import _PROTOCOL
from kvbridge.control.requests import RequestStats

#: what a peer never sends as a request: replies, and the channel's own authentication
NOT_REQUESTS = {messages.Ok, messages.Digest, messages.ErrorReply, messages.Hello,
                messages.Challenge, messages.Auth, messages.AuthRefused}  # fmt: skip
#: replies to ``kvbridge check``'s requests (``Describe``, ``ProbeConnect``, ``Probe``)
NOT_REQUESTS |= {messages.About, messages.ProbeScratch, messages.ProbeResult}


def test_every_request_type_has_one_answer() -> None:
    on_the_wire = set(typing.get_args(messages.AnyMessage))
    assert set(_PROTOCOL) == on_the_wire - NOT_REQUESTS


def test_push_done_carries_its_figures_both_ways() -> None:
    stats = RequestStats(
        nbytes=10,
        descriptors=2,
        descriptors_before_merge=3,
        plan_s=0.5,
        transfer_s=1.5,
        queued_s=9.0,
    )
    sent = PushDone("r", True, "", stats.figures(), digest=7)
    got = decode(encode(3, sent)).body
    assert isinstance(got, PushDone) and got == sent and not got.unproven
    load = RequestStats(nbytes=1, plan_s=1.0, transfer_s=0.5)
    load.add_pushed(got.figures)
    load.add_pushed(TransferFigures(unproven=True))
    assert (load.nbytes, load.descriptors, load.descriptors_before_merge) == (11, 2, 3)
    assert (load.plan_s, load.transfer_s, load.unproven, load.queued_s) == (1.0, 1.5, True, 0.0)
    assert PushDone("r", False).figures == TransferFigures()
