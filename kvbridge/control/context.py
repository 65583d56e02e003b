"""What the control plane's roles share, handed to each of them explicitly.

``ControlPlane`` builds one ``PlaneContext`` and gives it to its roles (``Handshakes``,
``Transfers``, ``Leases``, ``Loads``, and the ``LoadBook``, ``Pulls`` and ``Pushes`` of
``Loads``) instead of itself: a role reads what it needs here, never another object's private
fields, and this is the whole list of what they share.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvbridge.control.deadlines import Deadlines
from kvbridge.control.requests import RequestOutcome
from kvbridge.core.integrity import Verify
from kvbridge.core.layout import Layout
from kvbridge.core.transport import Transport


@dataclass
class PlaneContext:
    """One engine's shared state and worker pools, as its control plane's roles use them.

    Set once by the plane, except ``deadlines`` and ``verify`` (the plane's settings, which the
    plane may change: the roles read them at each use), ``endpoint`` (known once the plane's
    side channel is open, before any peer can reach a role) and ``closing``.
    """

    engine_id: str
    layout: Layout
    transport: Transport
    #: one lock for the plane and its roles: a step may read a lease and a peer together
    lock: threading.RLock
    #: make a request's outcome available to the plane's ``poll_finished``/``wait``; lock held
    record: Callable[[RequestOutcome], None]
    deadlines: Deadlines
    verify: Verify
    #: the request workers: each request's own steps (a pull, P's push, D's check of a push,
    #: telling P a release or an abort), bounded by ``deadlines``
    requests: ThreadPoolExecutor
    #: waits that last as long as a frozen peer: fences, settling a push with P, telling D how
    #: a push ended, the transport's connect to a peer, asking P's digest. Their own pool, so
    #: that they never take a request worker (a frozen peer would starve every request) and a
    #: fence never queues behind requests waiting for workers
    peer_waits: ThreadPoolExecutor
    #: D's asks to P that wait on P (``PushRequest``, a layer-wise pull's ``StreamRequest``),
    #: one per P rank of a request (a pull's ``PullStart`` goes out from the request worker,
    #: which plans while P answers)
    asks: ThreadPoolExecutor
    #: P's digests for D's checks: memory-bound, off the endpoint's thread
    digests: ThreadPoolExecutor
    #: the side-channel address peers reach this engine at ("" until the endpoint is open)
    endpoint: str = ""
    #: set once the plane is closing: waits and retries stop
    closing: threading.Event = field(default_factory=threading.Event)

    @property
    def closed(self) -> bool:
        """Whether the plane is closing (or closed)."""
        return self.closing.is_set()
