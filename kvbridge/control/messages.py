"""Typed, versioned side-channel messages (msgspec), decoded strictly.

Every message travels in an ``Envelope`` carrying the protocol version and a sequence number that
pairs a reply with its request. Block ids are ``dict[group index, list[id]]``; sizes are bounded
so a malformed or hostile message is rejected before it costs memory.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvbridge.core.errors import MessageError
from kvbridge.core.layout import LayoutSpec

#: 8: ``PushRequest.first_token``/``DigestRequest.first_token`` (P and D of different block
#: sizes pair tokens: where D's blocks start).
#: 7: ``LayersReady.first_blocks``/``total_blocks`` and ``TransferFigures.streamed_parts``
#: (the chunks of a chunked prefill stream as they are computed).
#: 6: ``StreamRequest`` and ``LayersReady`` (layer-wise pull).
#: 5: ``TransferParams.published_at``, ``TransferFigures.landed_after_s``.
#: 4: ``TransferFigures.streamed_nbytes``, ``PushDone.source_block_ids`` (layer-wise push).
#: 3: D's requests carry the request's capability ``token``; ``AuthRefused``. 2: ``PushDone``
#: carries its figures as one ``TransferFigures``; 1: six fields of its own.
PROTOCOL_VERSION = 9
#: Largest message an endpoint accepts; a layout of a few hundred layers is far below it.
MAX_MESSAGE_BYTES = 8 << 20

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
#: The request's token at which D's blocks start (its local prefix hit): groups whose block
#: sizes differ between P and D pair tokens from there (``plan_transfers``).
FirstToken = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
#: The wire form of ``kvbridge.core.block_mapping.GroupBlockIds`` (block ids per group), bounded.
BlockIds = dict[Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)], list[BlockId]]
#: A count or a position in blocks, per group.
BlockCounts = dict[Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)], BlockId]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Proof = Annotated[bytes, msgspec.Meta(max_length=64)]
Reason = Annotated[str, msgspec.Meta(max_length=4096)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 12)]
TPSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 12)]
#: A request's capability token (``TransferParams.token``): P serves a request only to its bearer.
Token = Annotated[str, msgspec.Meta(max_length=128)]


class Message(msgspec.Struct, forbid_unknown_fields=True, tag_field="type"):
    """Base of every side-channel message."""


# -- authentication -------------------------------------------------------------------------------
class Hello(Message, tag="hello"):
    """Client -> server: who I am and a fresh nonce for the server to prove itself with."""

    engine_id: EngineId
    nonce: Nonce


class Challenge(Message, tag="challenge"):
    """Server -> client: the server's nonce, and its proof over the client's nonce."""

    engine_id: EngineId
    nonce: Nonce
    proof: Proof


class Auth(Message, tag="auth"):
    """Client -> server: the client's proof over the server's nonce."""

    proof: Proof


class AuthRefused(Message, tag="auth_refused"):
    """Client -> server: the server's proof did not verify (a secret differs, or is set on one
    side only); the client sends no proof of its own and stops. Lets the server log the failure
    too: otherwise only the client would know."""

    reason: Reason = ""


# -- handshake ------------------------------------------------------------------------------------
class Handshake(Message, tag="handshake"):
    """Either direction: an engine's layout and how its transport is reached."""

    engine_id: EngineId
    layout: LayoutSpec
    transport: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    metadata: Annotated[bytes, msgspec.Meta(max_length=1 << 20)]
    endpoint: Annotated[str, msgspec.Meta(max_length=512)] = ""


# -- request flow ---------------------------------------------------------------------------------
class FromDecodeRank(Message, kw_only=True):
    """A message a decode worker sends about a request: which TP rank of which TP size it is,
    of which pipeline stage of how many (P learns which D workers end its lease: every stage's
    ``kvbridge.core.tp.reporting_ranks``)."""

    rank: Rank = 0
    tp_size: TPSize = 1
    #: the request's capability token (``TransferParams.token``): P answers only its bearer
    token: Token = ""
    pp_rank: Rank = 0
    pp_size: TPSize = 1

    @property
    def reader(self) -> int:
        """The D worker's index among D's ``pp_size * tp_size`` (stage-major)."""
        return self.pp_rank * self.tp_size + self.rank


class PullStart(FromDecodeRank, tag="pull_start"):
    """D -> P (pull): D is about to read these P blocks of the request."""

    request_id: RequestId
    block_ids: BlockIds


class Release(FromDecodeRank, tag="release"):
    """D -> P (pull): D is done with the request (read it, or gave up); P may free its blocks."""

    request_id: RequestId
    ok: bool = True
    reason: Reason = ""


class Abort(FromDecodeRank, tag="abort"):
    """D -> P: D no longer wants the request; P frees its blocks at once."""

    request_id: RequestId
    reason: Reason = ""


class PushRequest(FromDecodeRank, tag="push_request"):
    """D -> P (push): write the request into these D blocks, then send ``PushDone``.

    ``verify`` (``off``, ``sample``, ``full``): P adds the digest of what it wrote.
    """

    request_id: RequestId
    block_ids: BlockIds
    verify: Annotated[str, msgspec.Meta(max_length=16)] = "off"
    first_token: FirstToken | None = None


class TransferFigures(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a transfer moved and how long its steps took: P's push tells D its own
    (``PushDone``), which D counts into the load's ``RequestStats`` (``add_pushed``; the
    fields are those of ``RequestStats``, which ``RequestStats.figures`` copies out)."""

    nbytes: int = 0
    descriptors: int = 0
    descriptors_before_merge: int = 0
    plan_s: float = 0.0
    transfer_s: float = 0.0
    #: no fence proves the transfer's bytes stopped (``Fence.UNPROVEN``)
    unproven: bool = False
    #: of ``nbytes``, what P wrote layer by layer before it published the request
    streamed_nbytes: int = 0
    #: the parts it wrote them in: one per prefill step (a chunked prefill's chunks)
    streamed_parts: int = 0
    #: seconds from P's answer (``TransferParams.published_at``) to the push's last byte landed
    landed_after_s: float = 0.0


class PushDone(Message, tag="push_done"):
    """P -> D (push): the request's bytes are written (``ok``) or will never be.

    Sent only after P's fence: no byte of a failed write is still in P's engine. ``unproven``:
    P's fence proves nothing (``Fence.UNPROVEN``: part of the write may still be applied in D's
    memory), so D keeps the blocks held for good.
    """

    request_id: RequestId
    ok: bool
    reason: Reason = ""
    #: what P's write moved and how long it took (a failed one: only ``unproven``)
    figures: TransferFigures = msgspec.field(default_factory=TransferFigures)
    #: digest of the bytes written, when the push request asked for a check
    digest: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: with a digest: P's block ids it wrote from, which D plans its check with when it never
    #: had them (the concurrent dispatch: D asked before P computed the request)
    source_block_ids: BlockIds | None = None

    @property
    def unproven(self) -> bool:
        return self.figures.unproven


class PushQuery(FromDecodeRank, tag="push_query"):
    """D -> P (push): how did the push of this request end? ``PushDone`` if it ended, ``Ok`` while
    P may still write, ``unknown_request`` when P holds no write of it (D missed ``PushDone``,
    or gave up waiting and must know that no byte can still arrive)."""

    request_id: RequestId


class StreamRequest(FromDecodeRank, tag="stream_request"):
    """D -> P (layer-wise pull, before P published the request): tell me each layer of it as you
    compute it (``LayersReady``), and hold it for me once published (my claim, as ``PullStart``)."""

    request_id: RequestId


LayerName = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class LayersReady(Message, tag="layers_ready"):
    """P -> D (layer-wise pull): these layers of the request are computed in these P blocks.

    A chunked prefill tells each chunk's blocks as a part: ``source_block_ids`` then name P's
    blocks from position ``first_blocks`` of each group on (0 when absent), of the
    ``total_blocks`` P holds for the group once the prefill ends (as many as named when
    absent); see ``kvbridge.control.streams``.

    ``published``: P published the request and holds it for D (claimed, as after ``PullStart``):
    ``source_block_ids`` are then every group's, and D reads what it has not read yet, then
    releases it. ``ok`` false: P will not publish it (``reason``; D computes the prompt)."""

    request_id: RequestId
    source_block_ids: BlockIds = {}
    layers: Annotated[list[LayerName], msgspec.Meta(max_length=1 << 16)] = []
    first_blocks: BlockCounts = {}
    total_blocks: BlockCounts = {}
    published: bool = False
    num_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: P's stamp of its answer (``TransferParams.published_at``), which D's params lack
    published_at: float = 0.0
    ok: bool = True
    reason: Reason = ""


class DigestRequest(FromDecodeRank, tag="digest_request"):
    """D -> P (pull, ``verify`` on): digest the bytes D read into these D blocks, as P has them."""

    request_id: RequestId
    block_ids: BlockIds
    verify: Annotated[str, msgspec.Meta(max_length=16)]
    first_token: FirstToken | None = None


class Digest(Message, tag="digest"):
    """P -> D: the digest asked for."""

    value: Annotated[int, msgspec.Meta(ge=0)]


class Ping(Message, tag="ping"):
    """Any -> any: answered ``Ok`` (the peer is alive and serving)."""


# -- replies --------------------------------------------------------------------------------------
class Ok(Message, tag="ok"):
    """A request succeeded."""


class ErrorReply(Message, tag="error"):
    """A request was refused; ``code`` is stable for programs, ``message`` is for people."""

    code: Annotated[str, msgspec.Meta(max_length=64)]
    message: Reason


# -- preflight (``kvbridge check``) -------------------------------------------------------------
#: The most scratch bytes a probe moves; an engine's probe scratch is at most this large.
MAX_PROBE_BYTES = 64 << 10
ProbeBytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_PROBE_BYTES)]


class Describe(Message, tag="describe"):
    """Checker -> any engine: who are you? Answered ``About``; nothing is connected or kept."""


class About(Message, tag="about"):
    """An engine's answer to ``Describe``: its versions, its handshake (layout, transport and
    transport metadata, as it answers a ``Handshake``) and the size of its probe scratch
    (0: it serves no probe)."""

    kvbridge_version: Annotated[str, msgspec.Meta(max_length=64)]
    protocol_version: int
    handshake: Handshake
    probe_bytes: ProbeBytes = 0


class ProbeConnect(Message, tag="probe_connect"):
    """Checker -> engine: connect your transport to mine (``metadata``) for probes; my scratch
    buffer is ``scratch_bytes`` long. Answered ``ProbeScratch``. The engine connects under a
    peer name of its own for probes, never one a serving peer uses."""

    transport: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    metadata: Annotated[bytes, msgspec.Meta(max_length=1 << 20)]
    scratch_addr: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    scratch_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_PROBE_BYTES)]


class ProbeScratch(Message, tag="probe_scratch"):
    """Engine -> checker: where the engine's probe scratch is (the checker writes only there)."""

    addr: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    size: ProbeBytes


class Probe(Message, tag="probe"):
    """Checker -> engine, after ``ProbeConnect``. Offsets count from each side's scratch start.

    ``write``: fill ``[offset, offset + length)`` of your scratch with fresh random bytes and
    write them, through the transport, to the same range of mine; ``digest``: the digest of that
    range of your scratch (what I wrote there); ``end``: disconnect from me. A range beyond
    either scratch is refused: a probe never touches any other memory.
    """

    action: Literal["write", "digest", "end"]
    offset: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROBE_BYTES)] = 0
    length: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROBE_BYTES)] = 0


class ProbeResult(Message, tag="probe_result"):
    """Engine -> checker: the SHA-256 of the probed range of its scratch (``write``: what it
    wrote; ``digest``: what it holds), and how long the transfer took."""

    digest: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    seconds: float = 0.0


AnyMessage = (
    Hello
    | Challenge
    | Auth
    | AuthRefused
    | Handshake
    | PullStart
    | Release
    | Abort
    | PushRequest
    | PushDone
    | PushQuery
    | StreamRequest
    | LayersReady
    | DigestRequest
    | Digest
    | Ping
    | Ok
    | ErrorReply
    # preflight (``kvbridge check``)
    | Describe
    | About
    | ProbeConnect
    | ProbeScratch
    | Probe
    | ProbeResult
)


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What goes on the wire: protocol version, sequence number, one message."""

    version: int
    seq: Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
    body: AnyMessage


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(seq: int, body: Message) -> bytes:
    return _encoder.encode(Envelope(PROTOCOL_VERSION, seq, body))  # type: ignore[arg-type]


def decode(data: bytes) -> Envelope:
    """Decode one envelope strictly; ``MessageError`` says what is wrong."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError("too_large", f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        envelope = _decoder.decode(data)
    except msgspec.ValidationError as err:
        raise MessageError("invalid", f"invalid message: {err}") from None
    except msgspec.DecodeError as err:
        raise MessageError("malformed", f"malformed message: {err}") from None
    if envelope.version != PROTOCOL_VERSION:
        raise MessageError(
            "version",
            f"protocol version {envelope.version} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same kvbridge version on both engines",
        )
    return envelope
