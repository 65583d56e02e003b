"""Exceptions raised by kvbridge. Every message says what was wrong and what to do."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KvbridgeError(Exception):
    """Base class of every error kvbridge raises on purpose."""


class LayoutError(KvbridgeError, ValueError):
    """A layout (groups, tensors, regions) is inconsistent on its own."""


class LayoutMismatchError(LayoutError):
    """Two layouts cannot exchange KV blocks; ``differences`` lists every differing field."""

    def __init__(self, differences: list[str]) -> None:
        self.differences = list(differences)
        super().__init__(
            "layouts are incompatible: "
            + "; ".join(self.differences)
            + " (both engines must serve the same model with the same cache configuration)"
        )


class BlockIdError(KvbridgeError, ValueError):
    """Block ids are out of range or cannot be aligned between the two sides."""


class PlanError(KvbridgeError):
    """A transfer plan would be wrong (for example, overlapping destinations)."""


class TransportError(KvbridgeError):
    """Base class of transport failures."""


class TransportNotFoundError(TransportError, LookupError):
    """No transport is installed under the requested name."""


class TransportConflictError(TransportError):
    """Two transports claim one name: two installed distributions declare it, or a registration
    would shadow an installed or registered one without ``replace=True``."""


class TransportUnavailableError(TransportError, ImportError):
    """The transport is installed but its engine library cannot be loaded."""


class TransportOptionError(TransportError, ValueError):
    """A transport was given an option it does not take, or a value of the wrong type; the
    message names the transport, the option and the options it takes."""


class RegistrationError(TransportError):
    """Memory could not be registered, or a range used in a transfer is not registered."""


class PeerError(TransportError):
    """A peer is unknown, unreachable or sent unusable metadata."""


class PeerTimeoutError(PeerError, TimeoutError):
    """A peer did not answer within the timeout (dead, frozen or unreachable)."""


class PeerRefusedError(PeerError, ConnectionRefusedError):
    """Nothing accepts connections at the peer's address (its engine died or has not started).

    Raised as soon as a connection attempt is refused while none is up, instead of waiting out
    the timeout: a refusal is a definite answer (a frozen or unreachable peer still times out).
    """


class TransferError(TransportError):
    """An engine reported a failed transfer."""


class ChunkRefused(TransferError):
    """A transport's engine refused a chunk before sending any of it (the kit may start it again).

    Raised by a plugin's ``engine_start_chunk`` hook; callers of the transport never see it.
    """


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not finish within its timeout; its resources were released."""


class IntegrityError(KvbridgeError):
    """The bytes a side received differ from what the other side sent (``verify`` check)."""


class CodedError(KvbridgeError):
    """An error with the short ``code`` a control-plane ``ErrorReply`` carries."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class MessageError(CodedError, ValueError):
    """A received control message cannot be used; ``code`` is sent back in an ``ErrorReply``."""


class ControlError(CodedError):
    """A peer refused a control request (``code`` from its ``ErrorReply``)."""


class OutcomeTimeoutError(KvbridgeError, TimeoutError):
    """A request has no outcome yet after the time a caller was willing to wait."""


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid name closest to a mistyped ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
