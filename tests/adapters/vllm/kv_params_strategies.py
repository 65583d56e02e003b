"""Generated ``kv_transfer_params``, as any client of vLLM's API could send them.

One source for the scheduler's property test (``test_scheduler_input``) and for the fuzz through
vLLM's API server on real engines (``e2e/serve_stress``): wrong types, huge and negative ids,
unknown keys, broken tokens and addresses, around a well-formed base.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hypothesis import strategies as st

from kvbridge.adapters.vllm.scheduler import (
    BOOTSTRAP_KEY,
    LAYERWISE_KEY,
    PARAMS_KEY,
    PROCESSED_KEY,
)

#: any integer vLLM's API lets through (JSON numbers, int64 to uint64)
ANY_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
#: integers that are never a valid block id, token count or group of a real engine: a fuzz on
#: real engines must not forge a well-formed plan (a permutation of P's own block ids would load
#: other blocks of the same request, which only the request's own client can ask for)
INVALID_INT = st.integers(-(2**63), -1) | st.integers(2**40, 2**64 - 1)
#: KV cache group keys of ``block_ids``: a few real ones, negative ones, and strings
ANY_GROUP: st.SearchStrategy[int | str] = st.integers(-3, 5) | st.text(max_size=3)

#: the top-level keys a client may put in ``kv_transfer_params``, kvbridge's and others'
TOP_KEYS = [
    "do_remote_prefill",
    "do_remote_decode",
    PARAMS_KEY,
    LAYERWISE_KEY,
    BOOTSTRAP_KEY,
    "transfer_id",
    "remote_engine_id",
    "kvbridge_mode",
    PROCESSED_KEY,
]
#: bootstrap addresses that cannot be reached or parsed
BAD_BOOTSTRAP = ["http://127.0.0.1:99999", "http://[::1", "ftp://x:1", "x", "http://127.0.0.1:1"]


def values(ints: st.SearchStrategy[int] = ANY_INT) -> st.SearchStrategy[Any]:
    """Any JSON value (nested up to 12 leaves), its integers from ``ints``."""
    scalars = st.one_of(
        st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=12)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


@st.composite
def kvbridge_params(
    draw: st.DrawFn,
    good: Mapping[str, Any],
    ints: st.SearchStrategy[int] = ANY_INT,
    groups: st.SearchStrategy[int | str] = ANY_GROUP,
) -> object:
    """kvbridge's own parameters ``good`` with some fields broken (a truncated token among
    them), or any value at all."""
    if draw(st.booleans()):
        return draw(values(ints))
    broken = dict(good)
    for key in draw(st.lists(st.sampled_from([*good, "unknown"]), max_size=4)):
        broken[key] = draw(values(ints))
    if draw(st.booleans()):
        broken["block_ids"] = draw(
            st.dictionaries(groups, st.lists(ints | st.text(max_size=3), max_size=5), max_size=3)
        )
    if good.get("token") and draw(st.booleans()):
        broken["token"] = str(good["token"])[: draw(st.integers(0, len(good["token"]) - 1))]
    return broken


@st.composite
def transfer_params(
    draw: st.DrawFn,
    good: Mapping[str, Any],
    ints: st.SearchStrategy[int] = ANY_INT,
    groups: st.SearchStrategy[int | str] = ANY_GROUP,
) -> dict[str, Any]:
    """A ``kv_transfer_params`` object: some of ``TOP_KEYS``, kvbridge's own around ``good``."""
    params: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(TOP_KEYS), max_size=6)):
        if key == PARAMS_KEY:
            params[key] = draw(kvbridge_params(good, ints, groups))
        elif key in ("do_remote_prefill", "do_remote_decode"):
            params[key] = draw(st.booleans() | values(ints))
        elif key == BOOTSTRAP_KEY:
            params[key] = draw(st.sampled_from(BAD_BOOTSTRAP) | values(ints))
        else:
            params[key] = draw(values(ints))
    return params
