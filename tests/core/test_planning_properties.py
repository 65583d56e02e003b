"""Property tests: random layouts and block ids against the slow reference copy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbridge.core import (
    BlockIdError,
    CacheGroup,
    GroupKind,
    KVLayout,
    Layout,
    LayoutSpec,
    plan_transfers,
)

from .layouts import (
    Arena,
    apply_plan,
    attention_tensor,
    interleaved_tensors,
    mla_tensor,
    state_tensors,
)
from .reference import Refused, minimum_descriptor_count, reference_copy, reference_descriptors

KINDS = list(GroupKind)


@st.composite
def model(draw):
    """A model: groups with kinds, block sizes, layers and per-token/state sizes (no addresses).

    Several attention groups of their own sizes include a drafter's: vLLM 0.34 keeps draft
    layers (``AttentionSpec.is_draft``) in a group of their own."""
    groups = []
    for index in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(KINDS))
        block = draw(st.sampled_from([1, 2, 4, 8]))
        groups.append(
            {
                "index": index,
                "kind": kind,
                "block": block,
                "window": draw(st.integers(1, 3 * block)),
                "layers": draw(st.integers(1, 3)),
                "bytes_per_token": draw(st.integers(1, 6)),
                "conv": draw(st.integers(1, 40)),
                "ssm": draw(st.integers(1, 40)),
                # both sides describe a group's attention tensors alike: whole, or K and V
                "whole": draw(st.booleans()),
            }
        )
    return groups


@st.composite
def side(draw, groups):
    """One engine's layout choices for the model: pool sizes, kernel sizes, K/V layouts, order."""
    return {
        "num_blocks": draw(st.integers(4, 12)),
        "kernels": [
            draw(st.sampled_from([d for d in (1, 2, 4, 8) if g["block"] % d == 0])) for g in groups
        ],
        "kv_layouts": [
            draw(st.sampled_from([KVLayout.BLOCKS_FIRST, KVLayout.K_FIRST])) for _ in groups
        ],
        "shuffle": draw(st.randoms(use_true_random=False)),
        "pad": draw(st.integers(0, 16)),
        # block-outermost: a block holds every layer's page (kernel blocks equal the block)
        "interleave": [draw(st.booleans()) for _ in groups],
    }


def kernels(groups, choice) -> list[int]:
    """Kernel sizes per group: a block-outermost group keeps whole blocks (as vLLM does)."""
    return [
        g["block"] if mixed and g["kind"] is not GroupKind.STATE else k
        for g, k, mixed in zip(groups, choice["kernels"], choice["interleave"], strict=True)
    ]


def build(groups, choice, arena: Arena) -> Layout:
    cache_groups = [
        CacheGroup(
            g["index"],
            g["kind"],
            g["block"],
            choice["num_blocks"],
            kernel_block_size=k if g["kind"].paged else None,
            sliding_window=g["window"] if g["kind"] is GroupKind.SLIDING_WINDOW else None,
        )
        for g, k in zip(groups, kernels(groups, choice), strict=True)
    ]
    tensors = []
    for g, cg, kv, mixed in zip(
        groups, cache_groups, choice["kv_layouts"], choice["interleave"], strict=True
    ):
        kv = KVLayout.WHOLE if g["whole"] else kv
        if mixed and cg.kind is not GroupKind.STATE:
            names = [f"g{g['index']}.l{layer}" for layer in range(g["layers"])]
            tensors += interleaved_tensors(arena, names, cg, g["bytes_per_token"], kv)
            continue
        for layer in range(g["layers"]):
            name = f"g{g['index']}.l{layer}"
            if cg.kind is GroupKind.STATE:
                tensors += state_tensors(arena, name, cg, g["conv"], g["ssm"], choice["pad"])
            elif cg.kind is GroupKind.MLA:
                tensors.append(mla_tensor(arena, name, cg, g["bytes_per_token"]))
            else:
                tensors.append(attention_tensor(arena, name, cg, g["bytes_per_token"], kv))
            arena.allocate(choice["pad"])
    choice["shuffle"].shuffle(tensors)
    return Layout(LayoutSpec(cache_groups, tensors))


@st.composite
def request(draw, groups, p_blocks, d_blocks):
    """Block ids per group for both sides, as vLLM holds them: real ids in token order.

    Mostly P holds at least what D asks for; sometimes it holds fewer (or, for STATE, another
    number of slots), which the planner must refuse exactly when the reference does.
    """
    p_ids, d_ids = {}, {}
    for g in groups:
        if not draw(st.booleans()) and len(groups) > 1:
            continue
        n = draw(st.integers(0, min(p_blocks, d_blocks) - 1))
        if draw(st.integers(0, 4)) == 0:  # a pair that may have to be refused
            n_p = draw(st.integers(0, p_blocks - 1))
        else:
            n_p = n + draw(st.integers(0, p_blocks - 1 - n))
        p_real = draw(st.permutations(range(1, p_blocks)))[:n_p]
        d_real = draw(st.permutations(range(1, d_blocks)))[:n]
        if g["kind"] is GroupKind.STATE:
            # placeholders (id 0) anywhere before the real slots, as vLLM holds them
            if draw(st.integers(0, 4)) != 0:
                p_real = p_real[:n]
            p_ids[g["index"]] = [0] * draw(st.integers(0, 3)) + p_real
            d_ids[g["index"]] = [0] * draw(st.integers(0, 3)) + d_real
        else:
            # sliding-window groups: both sides hold the full list; both clip to the window
            p_ids[g["index"]] = p_real
            d_ids[g["index"]] = d_real
    return p_ids, d_ids


def draw_case(data):
    """A random model, both sides' layouts over their arenas, and a request's block ids:
    ``(p, d, pa, da, p_ids, d_ids)``."""
    groups = data.draw(model())
    p_choice, d_choice = data.draw(side(groups)), data.draw(side(groups))
    pa, da = Arena(), Arena(next=BASE_D)
    p, d = build(groups, p_choice, pa), build(groups, d_choice, da)
    p_ids, d_ids = data.draw(request(groups, p_choice["num_blocks"], d_choice["num_blocks"]))
    return p, d, pa, da, p_ids, d_ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_plan_matches_reference_or_both_refuse_stays_in_memory_and_is_minimal(data):
    p, d, pa, da, p_ids, d_ids = draw_case(data)
    try:
        reference = reference_descriptors(p, d, p_ids, d_ids)
    except Refused as why:
        event(f"refused: {str(why).split()[0]}")
        with pytest.raises(BlockIdError):
            plan_transfers(p, d, p_ids, d_ids)
        return
    plan = plan_transfers(p, d, p_ids, d_ids)

    # every descriptor lies inside registered memory, on both sides
    for addrs, layout in ((plan.src, p), (plan.dst, d)):
        for a, n in zip(addrs.tolist(), plan.lengths.tolist(), strict=True):
            assert any(r.addr <= a and a + n <= r.end for r in layout.registration)
    # destinations never overlap
    order = np.argsort(plan.dst)
    ends = plan.dst[order] + plan.lengths[order]
    assert bool(np.all(ends[:-1] <= plan.dst[order][1:]))
    assert_exact_and_minimal(data, plan, reference, pa, da)


def assert_exact_and_minimal(data, plan, reference, pa: Arena, da: Arena) -> None:
    """Applying the plan gives exactly what the reference gives, in the fewest descriptors."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src, dst = pa.materialise(rng), da.materialise(rng)
    expected = dst.copy()
    reference_copy(reference, src, expected)
    apply_plan(src, dst, plan.src, plan.dst, plan.lengths)
    np.testing.assert_array_equal(dst, expected)
    assert plan.count == minimum_descriptor_count(reference)


BASE_D = 1 << 21


@st.composite
def token_request(draw, p_groups, d_groups, p_blocks, d_blocks):
    """One request over groups whose block sizes may differ between P and D: ``N`` tokens,
    P's blocks from token 0, D's from its local hit ``first`` (a multiple of every D block
    size) on, as vLLM holds them; sometimes P holds too few, which both must refuse."""
    paged = [(p, d) for p, d in zip(p_groups, d_groups, strict=True) if p["kind"].paged]
    capacity = min(
        [(p_blocks - 1) * p["block"] for p, _ in paged]
        + [(d_blocks - 1) * d["block"] for _, d in paged]
        + [40]
    )
    tokens = draw(st.integers(1, max(1, capacity)))
    step = max([d["block"] for _, d in paged] + [1])
    first = step * draw(st.integers(0, (tokens - 1) // step))
    p_ids, d_ids = {}, {}
    for pg, dg in zip(p_groups, d_groups, strict=True):
        if not draw(st.booleans()) and len(p_groups) > 1:
            continue
        if pg["kind"] is GroupKind.STATE:
            slots = draw(st.permutations(range(1, min(p_blocks, d_blocks))))[:1]
            p_ids[pg["index"]] = [0] * draw(st.integers(0, 2)) + slots
            d_ids[dg["index"]] = [0] * draw(st.integers(0, 2)) + slots
            continue
        n_p = -(-tokens // pg["block"])
        n_d = -(-tokens // dg["block"]) - first // dg["block"]
        if draw(st.integers(0, 5)) == 0:  # a P that computed fewer tokens than D asks for
            n_p = draw(st.integers(0, n_p))
        p_ids[pg["index"]] = draw(st.permutations(range(1, p_blocks)))[:n_p]
        d_ids[dg["index"]] = draw(st.permutations(range(1, d_blocks)))[:n_d]
    return p_ids, d_ids, first


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_between_different_block_sizes_the_plan_matches_reference_and_is_minimal(data):
    """P and D whose logical and kernel block sizes differ (any of 1, 2, 4, 8 per side and
    group; sliding windows keep equal sizes): tokens pair, from P's first and from D's local
    hit on, whole and exact, in the fewest descriptors; refused exactly where the reference
    refuses. Cut by layer, every layer's part is its share of the whole."""
    groups = data.draw(model())
    d_groups = [
        dict(g, block=data.draw(st.sampled_from([1, 2, 4, 8])))
        if g["kind"] is not GroupKind.SLIDING_WINDOW
        else g
        for g in groups
    ]
    p_choice, d_choice = data.draw(side(groups)), data.draw(side(d_groups))
    pa, da = Arena(), Arena(next=BASE_D)
    p, d = build(groups, p_choice, pa), build(d_groups, d_choice, da)
    differ = any(g["block"] != h["block"] for g, h in zip(groups, d_groups, strict=True))
    event(f"sizes differ: {differ}")
    p_ids, d_ids, first = data.draw(
        token_request(groups, d_groups, p_choice["num_blocks"], d_choice["num_blocks"])
    )
    try:
        reference = reference_descriptors(p, d, p_ids, d_ids, dst_first_token=first)
    except Refused as why:
        event(f"refused: {str(why).split()[0]}")
        with pytest.raises(BlockIdError):
            plan_transfers(p, d, p_ids, d_ids, dst_first_token=first)
        return
    plan = plan_transfers(p, d, p_ids, d_ids, dst_first_token=first)
    assert_exact_and_minimal(data, plan, reference, pa, da)
    layered = plan_transfers(p, d, p_ids, d_ids, dst_first_token=first, by_layer=True)
    for name in layered.layers:
        part = layered.for_layers([name])
        one = reference_descriptors(p, d, p_ids, d_ids, layer=name, dst_first_token=first)
        assert part.count == minimum_descriptor_count(one)
        assert part.nbytes == sum(n for _, _, n in one)


@st.composite
def request_ids(draw, pool: int = 400):
    """Distinct ids in runs of a contiguous range, cut into chunks listed in a random order
    (runs that meet only once sorted), 1 to a few hundred of them: both sides of the
    planner's short-request threshold."""
    total = draw(st.integers(1, 300))
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=12))) if total > 1 else []
    bounds = [0, *cuts, total]
    chunks = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    order = draw(st.permutations(range(len(chunks))))
    start = draw(st.integers(0, pool - total))
    step = draw(st.sampled_from([1, 1, 2]))
    return [start + step * i for k in order for i in chunks[k]]


@settings(max_examples=400, deadline=None)
@given(
    src=request_ids(),
    dst_seed=st.integers(0, 2**32 - 1),
    steps=st.sampled_from(
        # (source step, destination step, length): dense blocks, blocks shorter than the step,
        # ids two apart per block, a step of zero (every id at one address)
        [(8, 8, 8), (16, 8, 8), (8, 16, 8), (16, 16, 8), (4, 4, 8), (4, 8, 8), (0, 8, 8)]
    ),
    sort_runs=st.booleans(),
    same_runs=st.booleans(),
)
def test_short_requests_find_the_runs_long_ones_do(src, dst_seed, steps, sort_runs, same_runs):
    """The runs of a short request are found on Python ints (``_runs_listed``), those of a
    long one with numpy (``_runs_vectorised``): for any ids both give the same runs."""
    from kvbridge.core.planning import _Rows, _runs_listed, _runs_vectorised

    rng = np.random.default_rng(dst_seed)
    if same_runs:  # the destination's runs line up with the source's
        dst = [i + 1000 for i in src]
    else:
        dst = (rng.permutation(len(src) + 40)[: len(src)] + 500).tolist()
        if rng.random() < 0.5:
            dst.sort()
    ss, ds, length = steps
    rows = _Rows(np.zeros(2, np.int64), np.zeros(2, np.int64), ss, ds, length)
    s, d = np.array(src, np.int64), np.array(dst, np.int64)
    listed = _runs_listed(s, d, rows, sort_runs)
    vectorised = _runs_vectorised(s, d, rows, sort_runs) if s.size > 1 else None
    event(f"runs: {'one' if listed is None else 'several'}")
    if listed is None or vectorised is None:
        assert listed is vectorised
        return
    for name in ("first_src", "first_dst", "blocks"):
        assert getattr(listed, name).tolist() == getattr(vectorised, name).tolist(), name
    assert (listed.row_length, listed.dst_low, listed.dst_high) == (
        vectorised.row_length,
        vectorised.dst_low,
        vectorised.dst_high,
    )
