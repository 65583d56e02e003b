"""The concurrent dispatch: what a router gives P and D when both get a request at once.

In vLLM's P/D convention a router sends the prompt to P, waits for P's answer and its
``kv_transfer_params``, then sends the prompt to D with them: D learns the request only after P
computed it. For layer-wise transfer D must know the request while P computes it, so that P can
write each layer into D's blocks as soon as it is computed. The router then makes one transfer id
and one capability token, and sends both requests at once:

- to P: ``{"do_remote_decode": True, "kvbridge_layerwise": {"id", "token", "mode"}}``; P
  publishes the request under that id and token, and streams its layers as it computes them;
- to D: ``{"do_remote_prefill": True, "kvbridge": TransferParams(...)}`` naming P's side channel
  (from any earlier answer of that P: ``prefill_address``), the same id and token, no block ids
  (P's are not known yet), ``layerwise: True``, and the mode. D allocates its blocks and asks P
  at once: for a push (P writes each layer into D's blocks as it computes it), or for a pull
  (P tells D each computed layer, D reads it while P computes the next, and the rest once P
  published). The mode is P's, as its earlier answer named it (the connector's ``mode``
  option), unless the router chooses one: a deployment chooses as for whole-request transfers.

The token is as unguessable as the one P makes itself (``kvbridge.control.auth.new_token``) and
grants what P's does: only the bearer's push is served. The router is the only party that sees
both requests, so it must not take the id or token from a client.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from kvbridge.control import auth
from kvbridge.control.requests import Mode, TransferParams, address_of

# The two keys are the contract between a router and kvbridge's vLLM connector; they live here,
# on the router's side, so that the router needs nothing of the adapter (nor vLLM) to write them.

#: The key of our ``TransferParams`` inside vLLM's ``kv_transfer_params``.
PARAMS_KEY = "kvbridge"
#: On P's request in the concurrent dispatch (layer-wise): ``{"id": transfer id, "token":
#: capability, "mode": push or pull}``, made by the router, which gives D the same in its
#: ``kvbridge`` params (``TransferParams.layerwise``). P publishes the request under that id and
#: streams its layers.
LAYERWISE_KEY = "kvbridge_layerwise"


def prefill_address(kv_transfer_params: Mapping[str, Any]) -> dict[str, Any] | None:
    """The part of a P answer's ``kv_transfer_params`` that names P (and the mode it published
    in), or ``None`` without one (P declined to hold the request, or answered with another
    connector's parameters)."""
    raw = kv_transfer_params.get(PARAMS_KEY)
    if not isinstance(raw, Mapping):
        return None
    try:
        TransferParams.from_dict(raw)
    except Exception:
        return None
    return address_of(raw)


def concurrent_params(
    address: Mapping[str, Any], mode: Mode | str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(to P, to D)``: the ``kv_transfer_params`` of one request sent to both at once.

    ``address``: ``prefill_address`` of an earlier answer of the P the request goes to;
    ``mode``: layer-wise push or pull (default: the mode of that answer, else push).
    """
    chosen = Mode(mode or address.get("mode") or Mode.PUSH.value)
    transfer_id, token = f"kvbridge-{uuid.uuid4().hex}", auth.new_token()
    to_p = {
        "do_remote_decode": True,
        LAYERWISE_KEY: {"id": transfer_id, "token": token, "mode": chosen.value},
    }
    transfer = TransferParams.layerwise_of(address, transfer_id, token, chosen)
    to_d = {"do_remote_prefill": True, PARAMS_KEY: transfer.to_dict()}
    return to_p, to_d
