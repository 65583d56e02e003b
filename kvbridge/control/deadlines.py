"""Every time bound of the control plane, derived in one place from its three settings.

``ControlPlane`` takes ``timeout`` (one side-channel call, and the transport's bound on one
transfer: the adapters give both the same value), ``lease`` (how long P keeps a published
request's blocks that D never released) and ``handshake_timeout`` (how long a handshake
retries). The
roles read the bounds below instead of deriving their own from those three.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Deadlines:
    """The plane's time bounds (seconds), all derived from ``timeout``, ``lease`` and
    ``handshake_timeout``; ``ValueError`` when they cannot hold together."""

    #: one side-channel call (request and answer); also the transport's bound on one transfer
    timeout: float = 10.0
    #: how long P holds a published request's blocks when D never releases them
    lease: float = 30.0
    #: how long a handshake with a P rank retries before it fails
    handshake_timeout: float = 10.0
    #: how long P holds a published request no D rank claimed (None: ``claim`` derives it)
    claim_timeout: float | None = None
    #: how long a side-channel connection may stay unused before it is closed (None: ``quiet``
    #: derives it)
    quiet_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("timeout", "lease", "handshake_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if self.claim_timeout is not None and not 0 < self.claim_timeout <= self.lease:
            raise ValueError(
                f"claim_timeout must be > 0 and at most the lease ({self.lease:g} s), got "
                f"{self.claim_timeout!r}"
            )
        if self.lease < self.read_hold:
            raise ValueError(
                f"lease ({self.lease:g} s) must be at least twice the timeout "
                f"({self.timeout:g} s): P must not free blocks that D may still be reading; "
                "raise lease"
            )

    @property
    def call(self) -> float:
        """One side-channel request until its answer (every ``PeerClient.request``)."""
        return self.timeout

    @property
    def slow_after(self) -> float:
        """A request that takes this long logs where its time went (a quarter of the timeout:
        well before it fails, so a slow load is explained while it still succeeds)."""
        return self.timeout / 4

    @property
    def read_hold(self) -> float:
        """P keeps a request's blocks at least this long after D said it reads them
        (``PullStart``), whatever is left of the lease: D's read may take the transport's
        timeout, and its engine as long again to give the read back. Hence ``lease`` is at
        least this (the blocks must outlive a read that started right after publishing)."""
        return 2 * self.timeout

    @property
    def claim(self) -> float:
        """P frees a published request that no D rank claimed (``PullStart``, ``PushRequest``,
        a release) this long after publishing: an unclaimed hold ends sooner than a claimed one
        (``lease``), so prefills nobody reads cost P's memory for less time. By default half
        the lease, but never less than a D's first contact can take (a handshake, then one
        call), nor more than the lease."""
        if self.claim_timeout is not None:
            return self.claim_timeout
        return min(self.lease, max(self.lease / 2, self.handshake_timeout + self.timeout))

    @property
    def load(self) -> float:
        """D's overall bound on one load, from ``pull``/``push`` on: a handshake, then queueing
        and the transfer (twice the timeout, as P's ``read_hold``). A push past it is settled
        with P; the settling waits this long for the push request itself to have been sent."""
        return self.handshake_timeout + 2 * self.timeout

    @property
    def publish_wait(self) -> float:
        """How long D's ``PullStart`` waits for P to publish a request it has not yet (a serving
        engine may hand D the parameters one engine step before P's worker publishes)."""
        return self.timeout

    @property
    def remember(self) -> float:
        """How long ids are remembered after they ended: requests D aborted (either side),
        pushes D asked for before P published, and how P's pushes ended (D may ask again).
        The lease: nothing of a request can arrive later than its lease would have lasted."""
        return self.lease

    @property
    def connect(self) -> float:
        """P's wait for its transport to reach D before a push (the connect started when D's
        handshake was answered)."""
        return self.timeout

    @property
    def fence_round(self) -> float:
        """One wait for a given-up transfer's fence; the wait repeats (logged) until it ends."""
        return self.timeout

    @property
    def quiet(self) -> float:
        """A side-channel connection no call used for this long is closed (and made again at the
        next call, one authentication round trip): the lease, but at least a minute, so that a
        peer with steady traffic never pays it and one that left costs nothing after."""
        if self.quiet_timeout is not None:
            return self.quiet_timeout
        return max(60.0, self.lease)

    @property
    def retry_pause(self) -> float:
        """The pause before asking a P that did not answer again (at most a second)."""
        return min(1.0, self.timeout)

    def handshake_attempt(self, left: float) -> float:
        """The bound of one handshake attempt with ``left`` seconds of the handshake's retries
        left: one call, cut to what is left, but at least 0.1 s (an attempt needs a round
        trip)."""
        return min(self.timeout, max(0.1, left))
