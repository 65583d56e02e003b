"""Pipeline stages: every stage of P against every stage of D moves exactly what the whole
engines move (the TP planner, already checked against its per-unit reference), with vLLM's
own split of layers into stages (``get_pp_indices``), any PP and TP sizes on either side."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.utils import get_pp_indices

from kvbridge.core import Layout, LayoutMismatchError, check_compatible
from kvbridge.core.errors import PlanError
from kvbridge.core.planning import plan_transfers
from kvbridge.core.rank_slices import check_coverage
from kvbridge.core.stages import layer_names, only_layers, stage_pair
from kvbridge.core.tp import contact_ranks, plan_tp_pair, plan_tp_reads

from .layouts import Arena, apply_plan
from .test_tp import MODELS, request
from .tp_layouts import build_rank, build_side
from .tp_reference import TPModel

PPS = [1, 2, 3]


def stage_of(whole: Layout, num_layers: int, pp_rank: int, pp_size: int) -> Layout:
    """Stage ``pp_rank`` of an engine whose worker held ``whole``: vLLM's layers of that stage
    alone, at the same addresses (a stage allocates only its own layers' caches)."""
    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    names = {t.layer_name for t in whole.spec.tensors}
    keep = frozenset(n for n in names if int(n.split(".")[0][1:]) in range(start, end))
    return only_layers(whole, keep, (pp_rank, pp_size))


def check_stages(
    m: TPModel, pp: tuple[int, int], tp: tuple[int, int], d_rank: int, seed: int
) -> None:
    """D rank ``d_rank`` of every D stage loads from every P stage's contact ranks: the bytes
    land as the whole engines' plans put them, each written once, pull and push alike."""
    (pp_p, pp_d), (tp_p, tp_d) = pp, tp
    rng = np.random.default_rng(seed)
    p_whole, p_arenas = build_side(m, tp_p, 2)
    d_arena = Arena()
    d_whole = build_rank(m, d_rank, tp_d, 2, d_arena)
    p_ids, d_ids = request(m, rng)
    p_mem = [a.materialise(rng) for a in p_arenas]
    d_mem = d_arena.materialise(rng)
    expected, got, pushed = d_mem.copy(), d_mem.copy(), d_mem.copy()
    contacts = contact_ranks(d_rank, tp_d, tp_p)
    whole_plans = plan_tp_reads({q: p_whole[q] for q in contacts}, d_whole, p_ids, d_ids)
    for q, plan in whole_plans.items():
        apply_plan(p_mem[q], expected, plan.src, plan.dst, plan.lengths)
    written = np.zeros(d_mem.size, dtype=np.int64)
    for d_stage in range(pp_d):
        d_layout = stage_of(d_whole, m.layers, d_stage, pp_d)
        sources = {
            s * tp_p + q: stage_of(p_whole[q], m.layers, s, pp_p)
            for s in range(pp_p)
            for q in contacts
        }
        plans = plan_tp_reads(sources, d_layout, p_ids, d_ids)
        for flat, plan in plans.items():
            apply_plan(p_mem[flat % tp_p], got, plan.src, plan.dst, plan.lengths)
            for d, n in zip(plan.dst.tolist(), plan.lengths.tolist(), strict=True):
                written[d : d + n] += 1
            # push: the P worker plans its writes to this D worker alone, to the same bytes
            push = plan_tp_pair(sources[flat], d_layout, p_ids, d_ids)
            assert push is not None and push.nbytes == plan.nbytes
            apply_plan(p_mem[flat % tp_p], pushed, push.src, push.dst, push.lengths)
        for flat in set(sources) - set(plans):  # a stage holding none of D's layers
            shared = layer_names(sources[flat]) & layer_names(d_layout)
            assert not shared or plan_tp_pair(sources[flat], d_layout, p_ids, d_ids) is None
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(pushed, expected)
    assert written.max(initial=0) <= 1  # no byte of D written twice
    assert sum(p.nbytes for p in whole_plans.values()) == int(written.sum()) > 0


@pytest.mark.parametrize("kind", ["attention K>=TP", "mla", "gdn hybrid SD", "swa+full"])
@pytest.mark.parametrize("pp", [(1, 2), (2, 1), (2, 3), (3, 2)], ids=lambda p: f"pp{p[0]}-{p[1]}")
@pytest.mark.parametrize("tp", [(1, 1), (2, 1), (1, 2)], ids=lambda t: f"tp{t[0]}-{t[1]}")
def test_stages_move_what_whole_engines_move(kind: str, pp, tp) -> None:
    m = MODELS[kind]
    m = TPModel(**{**m.__dict__, "layers": 5})
    for d_rank in range(tp[1]):
        check_stages(m, pp, tp, d_rank, seed=hash((kind, pp, tp, d_rank)) % 2**32)


@st.composite
def stage_case(draw):
    kind = draw(st.sampled_from(list(MODELS)))
    layers = draw(st.integers(1, 6))
    pp_p = draw(st.integers(1, min(layers, 4)))
    pp_d = draw(st.integers(1, min(layers, 4)))
    tp_p, tp_d = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    d_rank = draw(st.integers(0, tp_d - 1))
    m = TPModel(**{**MODELS[kind].__dict__, "layers": layers})
    return m, (pp_p, pp_d), (tp_p, tp_d), d_rank, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stage_case())
def test_stage_property(case) -> None:
    m, pp, tp, d_rank, seed = case
    check_stages(m, pp, tp, d_rank, seed)


def test_a_layer_no_stage_holds_is_named() -> None:
    m = TPModel("attention", kv_heads=2, layers=4)
    p_whole, _ = build_side(m, 1, 2)
    d_whole = build_rank(m, 0, 1, 2, Arena())
    only_first = {0: stage_of(p_whole[0], 4, 0, 2)}  # P's second stage is not asked
    with pytest.raises(LayoutMismatchError, match=r"l2\.g0.*held by no source rank"):
        check_coverage(only_first, d_whole)


def test_stages_compare_the_layers_both_hold() -> None:
    m = TPModel("attention", kv_heads=2, layers=4)
    p_whole, _ = build_side(m, 1, 2)
    d_whole = build_rank(m, 0, 1, 2, Arena())
    first, second = stage_of(p_whole[0], 4, 0, 2), stage_of(d_whole, 4, 1, 2)
    # no layer in common: compatible (nothing moves), and the planner says why it plans nothing
    check_compatible(first, second)
    assert stage_pair(first, second) is None
    assert plan_tp_pair(first, second, {0: [1]}, {0: [2]}) is None
    with pytest.raises(PlanError, match="no layer in common"):
        plan_transfers(first, second, {0: [1]}, {0: [2]})
    # a stage against a whole engine: the layers both hold, the same objects each time
    pair = stage_pair(first, d_whole)
    assert pair is not None and pair is stage_pair(first, d_whole)
    assert layer_names(pair[0]) == layer_names(pair[1]) == layer_names(first)
    # whole engines are left as they are
    assert stage_pair(p_whole[0], d_whole) == (p_whole[0], d_whole)


def test_a_stage_of_another_format_is_refused_on_what_both_hold() -> None:
    a = TPModel("attention", kv_heads=2, layers=4)
    b = TPModel("attention", kv_heads=2, layers=4, head_bytes=3)
    p_stage = stage_of(build_side(a, 1, 2)[0][0], 4, 0, 2)
    d_whole = build_rank(b, 0, 1, 2, Arena())
    with pytest.raises(LayoutMismatchError, match=r"l0\.g0"):
        check_compatible(p_stage, d_whole)
