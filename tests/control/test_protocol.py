"""The side-channel protocol as one table (no engines)."""

from __future__ import annotations

import typing

from kvbridge.control import messages
from kvbridge.control.plane import _PROTOCOL

#: what a peer never sends as a request: replies, and the channel's own authentication
NOT_REQUESTS = {messages.Ok, messages.Digest, messages.ErrorReply, messages.Hello,
                messages.Challenge, messages.Auth}  # fmt: skip


def test_every_request_type_has_one_answer() -> None:
    on_the_wire = set(typing.get_args(messages.AnyMessage))
    assert set(_PROTOCOL) == on_the_wire - NOT_REQUESTS
