"""A plan cut by layer (``plan_transfers(..., by_layer=True)``): one plan per request, each
layer's descriptors sendable on their own as soon as that layer is computed (issue 29).

Checked against the slow reference restricted to each layer: every layer's cut moves exactly
that layer's bytes with the minimum number of descriptors for that layer, and all cuts together
move exactly what the whole plan moves.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbridge.core import BlockIdError, plan_transfers
from kvbridge.core.errors import PlanError

from .layouts import Arena, apply_plan
from .reference import Refused, minimum_descriptor_count, reference_copy, reference_descriptors
from .test_planning_properties import BASE_D, draw_case


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_each_layer_cut_moves_exactly_that_layer_minimally(data):
    p, d, pa, da, p_ids, d_ids = draw_case(data)
    try:
        reference = reference_descriptors(p, d, p_ids, d_ids)
    except Refused:
        with pytest.raises(BlockIdError):
            plan_transfers(p, d, p_ids, d_ids, by_layer=True)
        return
    layered = plan_transfers(p, d, p_ids, d_ids, by_layer=True)
    whole = plan_transfers(p, d, p_ids, d_ids)
    moved = {t.layer_name for t in d.spec.tensors if t.group_index in d_ids}
    assert set(layered.layers) == moved
    assert layered.layer_starts is not None
    assert layered.layer_starts[0] == 0 and layered.layer_starts[-1] == layered.count
    assert layered.nbytes == whole.nbytes
    assert layered.count >= whole.count
    event("cut costs descriptors" if layered.count > whole.count else "cut costs nothing")

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src, initial = pa.materialise(rng), da.materialise(rng)
    for layer in layered.layers:
        cut = layered.for_layers([layer])
        assert cut.layers == (layer,)
        assert bool(np.all(cut.src[1:] > cut.src[:-1]))  # sorted by source, no repeats
        expected, got = initial.copy(), initial.copy()
        mine = reference_descriptors(p, d, p_ids, d_ids, layer=layer)
        reference_copy(mine, src, expected)
        apply_plan(src, got, cut.src, cut.dst, cut.lengths)
        np.testing.assert_array_equal(got, expected, err_msg=f"layer {layer}")
        assert cut.count == minimum_descriptor_count(mine)
    # every layer, in any order, is the whole request
    expected, got = initial.copy(), initial.copy()
    reference_copy(reference, src, expected)
    everything = layered.for_layers(reversed(layered.layers))
    apply_plan(src, got, everything.src, everything.dst, everything.lengths)
    np.testing.assert_array_equal(got, expected)
    assert everything.count == layered.count


def test_a_plan_not_made_by_layer_cannot_be_cut() -> None:
    from .layouts import hybrid_layout

    p, d = hybrid_layout(Arena()), hybrid_layout(Arena(next=BASE_D))
    ids = {g: [1, 2] for g in p.groups}
    plan = plan_transfers(p, d, ids, ids)
    with pytest.raises(PlanError, match="by_layer"):
        plan.for_layers(["anything"])
    layered = plan_transfers(p, d, ids, ids, by_layer=True)
    assert layered.for_layers(["not a layer"]).count == 0
    assert layered.for_layers([]).nbytes == 0
