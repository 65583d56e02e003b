"""TP mapping: plans between P and D of different TP sizes against the slow per-unit reference."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.adapters.vllm.shards import attention_shards, gdn_conv_shards, gdn_ssm_shards
from kvbridge.core import (
    CacheGroup,
    CacheTensor,
    GroupKind,
    KVLayout,
    Layout,
    LayoutError,
    LayoutMismatchError,
    LayoutSpec,
    check_compatible,
    plan_transfers,
)
from kvbridge.core.layout import Shard
from kvbridge.core.tp import (
    contact_ranks,
    plan_tp_pair,
    plan_tp_reads,
    plan_tp_transfers,
    reporting_ranks,
)

from .layouts import Arena, apply_plan
from .reference import minimum_descriptor_count
from .tp_layouts import NUM_BLOCKS, build_rank, build_side, tp_groups
from .tp_reference import (
    TPModel,
    reference_tp,
)

TPS = [1, 2, 4, 8]


def request(m: TPModel, rng: np.random.Generator) -> tuple[dict, dict]:
    p_ids, d_ids = {}, {}
    for g in tp_groups(m, m.block):
        n = int(rng.integers(1, NUM_BLOCKS - 1))
        if g.kind is GroupKind.STATE:
            p = rng.permutation(np.arange(1, NUM_BLOCKS))[:n].tolist()
            d = rng.permutation(np.arange(1, NUM_BLOCKS))[:n].tolist()
            p_ids[g.index], d_ids[g.index] = [0] * (n - 1) + p[-1:], [0] * (n - 1) + d[-1:]
        else:
            extra = int(rng.integers(0, NUM_BLOCKS - 1 - n + 1))
            p_ids[g.index] = rng.permutation(np.arange(1, NUM_BLOCKS))[: n + extra].tolist()
            d_ids[g.index] = rng.permutation(np.arange(1, NUM_BLOCKS))[:n].tolist()
    return p_ids, d_ids


def _inside(addrs, lengths, layout: Layout) -> bool:
    return all(
        any(r.addr <= a and a + n <= r.end for r in layout.registration)
        for a, n in zip(addrs.tolist(), lengths.tolist(), strict=True)
    )


def check_pair(
    m: TPModel, tp_p: int, tp_d: int, d_rank: int, kernels: tuple[int, int], seed: int
) -> tuple[int, int]:
    """Plan D rank ``d_rank`` from every P rank, apply, compare with the reference.

    Returns (descriptors, minimum descriptors) summed over P ranks.
    """
    rng = np.random.default_rng(seed)
    p_layouts, p_arenas = build_side(m, tp_p, kernels[0])
    d_arena = Arena()
    # D rank d_rank; the others are built too so addresses look like a real D rank's
    d_layout = build_rank(m, d_rank, tp_d, kernels[1], d_arena)
    p_ids, d_ids = request(m, rng)
    plans = plan_tp_transfers(p_layouts, d_layout, p_ids, d_ids)
    reference = reference_tp(m, p_layouts, d_layout, p_ids, d_ids)
    assert set(plans) == set(reference)
    # D plans from the P ranks it talks to alone (the control plane's view): the same plans
    contacts = contact_ranks(d_rank, tp_d, tp_p)
    assert set(plans) <= set(contacts)
    assert d_rank in reporting_ranks(contacts[0], tp_p, tp_d)
    mine = plan_tp_reads({q: p_layouts[q] for q in contacts}, d_layout, p_ids, d_ids)
    assert set(mine) == set(plans)
    for q, plan in mine.items():
        np.testing.assert_array_equal(plan.src, plans[q].src)
        np.testing.assert_array_equal(plan.dst, plans[q].dst)

    p_mem = [a.materialise(rng) for a in p_arenas]
    d_mem = d_arena.materialise(rng)
    expected = d_mem.copy()
    by_layers = d_mem.copy()  # the same request sent layer by layer (issue 29)
    for q, descs in reference.items():
        for s, d, n in descs:
            expected[d : d + n] = p_mem[q][s : s + n]
    got, want = 0, 0
    for q, plan in plans.items():
        assert _inside(plan.src, plan.lengths, p_layouts[q])
        assert _inside(plan.dst, plan.lengths, d_layout)
        apply_plan(p_mem[q], d_mem, plan.src, plan.dst, plan.lengths)
        got += plan.count
        want += minimum_descriptor_count(reference[q])
        assert plan.count == minimum_descriptor_count(reference[q]), (q, plan.count)
        # push: P rank q plans its writes to this D rank alone, to the same descriptors
        pushed = plan_tp_pair(p_layouts[q], d_layout, p_ids, d_ids)
        assert pushed is not None
        for a, b in zip(
            (pushed.src, pushed.dst, pushed.lengths),
            (plan.src, plan.dst, plan.lengths),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)
        layered = plan_tp_pair(p_layouts[q], d_layout, p_ids, d_ids, by_layer=True)
        assert layered is not None and layered.nbytes == plan.nbytes
        for layer in layered.layers:
            cut = layered.for_layers([layer])
            apply_plan(p_mem[q], by_layers, cut.src, cut.dst, cut.lengths)
    # every byte D needs is the reference's, and no other byte of D changed
    np.testing.assert_array_equal(d_mem, expected)
    np.testing.assert_array_equal(by_layers, expected)
    # the needed bytes were really written (the reference moves something for every D rank)
    assert sum(n for descs in reference.values() for _, _, n in descs) > 0
    if tp_p == tp_d and kernels[0] == kernels[1]:
        # equal TP, identical shards: exactly today's plan, from the same rank
        assert set(plans) == {d_rank}
        today = plan_transfers(p_layouts[d_rank], d_layout, p_ids, d_ids)
        for a, b in zip(
            (today.src, today.dst, today.lengths),
            (plans[d_rank].src, plans[d_rank].dst, plans[d_rank].lengths),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)
    return got, want


MODELS = {
    "attention K>=TP": TPModel("attention", kv_heads=8),
    "attention K<TP": TPModel("attention", kv_heads=2, kv_layout=KVLayout.K_FIRST),
    "swa+full": TPModel("swa", kv_heads=4, pad=2),
    "attention whole K|V": TPModel("attention", kv_heads=4, kv_layout=KVLayout.WHOLE, pad=2),
    "mla": TPModel("mla"),
    "gdn hybrid SD": TPModel("gdn", kv_heads=2, conv_layout="SD", state_len=3),
    "gdn hybrid DS": TPModel("gdn", kv_heads=2, conv_layout="DS", pad=4),
}


@pytest.mark.parametrize("kernels", [(2, 2), (4, 1)], ids=["kernel 2|2", "kernel 4|1"])
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("tp_p", TPS)
@pytest.mark.parametrize("tp_d", TPS)
def test_tp_pairs_every_d_rank(kind: str, tp_p: int, tp_d: int, kernels) -> None:
    m = MODELS[kind]
    for d_rank in range(tp_d):
        check_pair(m, tp_p, tp_d, d_rank, kernels, seed=tp_p * 100 + tp_d * 10 + d_rank)


@st.composite
def tp_case(draw):
    kind = draw(st.sampled_from(["attention", "swa", "mla", "gdn"]))
    block = draw(st.sampled_from([1, 2, 4]))
    kernel = draw(st.sampled_from([k for k in (1, 2, 4) if block % k == 0]))
    kernel_d = draw(st.sampled_from([k for k in (1, 2, 4) if block % k == 0]))
    m = TPModel(
        kind,
        kv_heads=draw(st.sampled_from([1, 2, 4, 8, 16])),
        head_bytes=draw(st.integers(1, 3)),
        block=block,
        layers=draw(st.integers(1, 2)),
        window=draw(st.integers(1, 3 * block)),
        latent_bytes=draw(st.integers(1, 4)),
        key_dim=draw(st.sampled_from([8, 16])),
        value_dim=draw(st.sampled_from([8, 16])),
        state_len=draw(st.integers(1, 3)),
        conv_layout=draw(st.sampled_from(["SD", "DS"])),
        v_heads=draw(st.sampled_from([8, 16])),
        ssm_head_bytes=draw(st.integers(1, 4)),
        kv_layout=draw(st.sampled_from(list(KVLayout))),
        pad=draw(st.integers(0, 3)) * 4,
    )
    tp_p, tp_d = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    d_rank = draw(st.integers(0, tp_d - 1))
    return m, tp_p, tp_d, d_rank, (kernel, kernel_d), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp_case())
def test_tp_property(case) -> None:
    m, tp_p, tp_d, d_rank, kernels, seed = case
    got, want = check_pair(m, tp_p, tp_d, d_rank, kernels, seed)
    assert got == want


@pytest.mark.parametrize("kv_layout", list(KVLayout))
@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 8), (8, 2), (1, 4), (4, 2)])
def test_padded_heads(tps, kv_layout) -> None:
    # heads unit_stride apart (padding after each): every head is its own run, pads untouched
    m = TPModel("attention", kv_heads=4, head_pad=2, kv_layout=kv_layout)
    for d_rank in range(tps[1]):
        got, want = check_pair(m, *tps, d_rank, (2, 2), seed=d_rank)
        assert got == want


# --- shards of vLLM's sharding ------------------------------------------------------------


def test_attention_shards_follow_vllm() -> None:
    # K >= T: contiguous slices
    assert [(s.start, s.count) for r in range(4) for s in attention_shards(8, r, 4, 10)] == [
        (0, 2),
        (2, 2),
        (4, 2),
        (6, 2),
    ]
    # K < T: head r // (T/K), replicas T/K
    shards = [attention_shards(2, r, 8, 10)[0] for r in range(8)]
    assert [s.start for s in shards] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [(s.replicas, s.replica) for s in shards[:4]] == [(4, 0), (4, 1), (4, 2), (4, 3)]


def test_gdn_conv_shards_sub_projections() -> None:
    q, k, v = gdn_conv_shards(16, 32, 3, 2, tp_rank=1, tp_size=4)
    assert (q.axis, q.start, q.count, q.offset) == ("conv_q", 4, 4, 0)
    assert (k.axis, k.start, k.count, k.offset) == ("conv_k", 4, 4, 8)
    assert (v.axis, v.start, v.count, v.offset) == ("conv_v", 8, 8, 16)
    assert (q.rows, q.row_stride, q.unit_bytes) == (3, 32, 2)
    q, _, v = gdn_conv_shards(16, 32, 3, 2, tp_rank=1, tp_size=4, conv_layout="DS")
    assert (q.rows, q.unit_bytes, v.offset) == (1, 6, 8 * 6)
    with pytest.raises(LayoutError, match="neither"):
        gdn_conv_shards(16, 32, 3, 2, 0, 4, conv_layout="XY")


# --- refusals -------------------------------------------------------------------------------


def _one_layer(shards, tp_rank, tp_size, block_bytes, kernel=2, token_major=False) -> Layout:
    g = CacheGroup(0, GroupKind.ATTENTION, 4, 4, kernel)
    t = CacheTensor(
        "l0", 0, 4096, 4 * block_bytes, block_bytes, token_major=token_major, shards=shards
    )
    return Layout(LayoutSpec([g], [t], tp_rank=tp_rank, tp_size=tp_size))


def test_interleaved_heads_are_refused() -> None:
    # token-major [N, H, C] blocks: each head is one run per token (rows of the block)
    def token_major(rank, tp):
        heads = 4 // tp
        return _one_layer(
            [Shard("kv_heads", rank * heads, heads, 2, rows=4, row_stride=heads * 2)],
            rank,
            tp,
            4 * heads * 2,
            token_major=True,
        )

    with pytest.raises(LayoutError, match=r"head-major KV cache layout.*LBHNC or LHBNC"):
        plan_tp_transfers([token_major(0, 1)], token_major(1, 2), {0: [1]}, {0: [2]})
    # equal TP sizes: the same rank's whole blocks move as today
    plans = plan_tp_transfers(
        [token_major(0, 2), token_major(1, 2)], token_major(1, 2), {0: [1]}, {0: [2]}
    )
    assert list(plans) == [1]


def test_units_no_source_rank_holds_are_named() -> None:
    one = TPModel("attention", kv_heads=1)
    two = TPModel("attention", kv_heads=2)
    p = build_rank(one, 0, 1, 2, Arena())
    d = build_rank(two, 1, 2, 2, Arena())
    with pytest.raises(LayoutMismatchError, match=r"axis 'kv_heads': units \[1, 2\) held by no"):
        plan_tp_transfers([p], d, {0: [1]}, {0: [2]})
    d0 = build_rank(two, 0, 2, 2, Arena())  # head 0 is there
    assert list(plan_tp_transfers([p], d0, {0: [1]}, {0: [2]})) == [0]


def test_mismatched_unit_bytes_are_refused() -> None:
    p = build_rank(TPModel("gdn", head_bytes=2), 0, 1, 2, Arena())
    d = build_rank(TPModel("gdn", head_bytes=4), 0, 2, 2, Arena())
    with pytest.raises(
        LayoutMismatchError,
        match="'kv_heads': source unit_bytes=8 rows=1, destination unit_bytes=16",
    ):
        plan_tp_transfers([p], d, {0: [1]}, {0: [2]})
    # the handshake check names it too, and accepts the right pair despite the TP sizes
    with pytest.raises(LayoutMismatchError, match="shards"):
        check_compatible(p, d)
    check_compatible(p, build_rank(TPModel("gdn"), 0, 2, 2, Arena()))


def test_different_tp_without_shards_is_refused() -> None:
    p = _one_layer(None, 0, 1, 64)
    d = _one_layer(None, 0, 2, 32)
    with pytest.raises(LayoutMismatchError, match="carry no shards"):
        plan_tp_transfers([p], d, {0: [1]}, {0: [2]})
    with pytest.raises(LayoutMismatchError, match="tp_size"):
        check_compatible(p, d)


def test_sliced_blocks_need_equal_kernel_sizes() -> None:
    m = TPModel("attention", kv_heads=4, units_token_major=False)
    p = build_rank(m, 0, 1, 4, Arena())
    d = build_rank(m, 0, 2, 2, Arena())
    with pytest.raises(LayoutError, match=r"not list their tokens in order \(Shard.token_major"):
        plan_tp_transfers([p], d, {0: [1]}, {0: [2]})
    # heads whose tokens lie in order move unit by unit between the kernel sizes
    m = TPModel("attention", kv_heads=4)
    p, d = build_rank(m, 0, 1, 4, Arena()), build_rank(m, 0, 2, 2, Arena())
    assert list(plan_tp_transfers([p], d, {0: [1]}, {0: [2]})) == [0]
    # equal TP sizes, units not in order: different kernel sizes are refused as today
    m = TPModel("attention", kv_heads=4, units_token_major=False)
    p, d = build_rank(m, 0, 1, 4, Arena()), build_rank(m, 0, 1, 2, Arena())
    with pytest.raises(LayoutMismatchError, match="do not hold tokens in order"):
        plan_tp_transfers([p], d, {0: [1]}, {0: [2]})


def test_read_twice_is_refused() -> None:
    # two P ranks claim the same heads without saying they are replicas
    m = TPModel("attention", kv_heads=2)
    p0 = build_rank(m, 0, 2, 2, Arena())
    t = p0.spec.tensors[0]
    p1 = Layout(
        msgspec.structs.replace(
            p0.spec,
            tp_rank=1,
            tensors=[
                msgspec.structs.replace(t, shards=[msgspec.structs.replace(t.shards[0], start=0)])
                for t in p0.spec.tensors
            ],
        )
    )
    d = build_rank(m, 0, 1, 2, Arena())
    with pytest.raises(
        LayoutMismatchError,
        match=r"units \[1, 2\) held by no source rank.*units \[0, 1\) read twice",
    ):
        plan_tp_transfers([p0, p1], d, {0: [1]}, {0: [2]})
    assert t.shards is not None


def test_invalid_shards_are_refused() -> None:
    bad = [Shard("kv_heads", 0, 2, 40)]  # 80 bytes of a 64-byte block
    with pytest.raises(LayoutError, match="reach byte 80 of a block of 64"):
        plan_tp_transfers(
            [_one_layer(bad, 0, 1, 64)], _one_layer(bad, 0, 2, 64), {0: [1]}, {0: [2]}
        )


def test_shards_in_json() -> None:
    m = TPModel("gdn")
    layout = build_rank(m, 1, 2, 2, Arena())
    again = Layout.from_json(layout.to_json())
    assert again.spec == layout.spec
    assert again.spec.tensors[-1].shards == gdn_ssm_shards(8, 1, 2, m.ssm_head_bytes)
    # a layout that says nothing about TP encodes as before: no "shards" key at all
    plain = Layout(
        LayoutSpec([CacheGroup(0, GroupKind.MLA, 4, 4)], [CacheTensor("l", 0, 64, 8, 8)])
    )
    assert b"shards" not in plain.to_json()
    with pytest.raises(LayoutError, match="unknown field"):
        Layout.from_json(layout.to_json().replace(b'"replica":0', b'"replica":0,"bogus":1', 1))


@pytest.mark.parametrize("tp_p", TPS)
@pytest.mark.parametrize("tp_d", TPS)
def test_contacts_and_reporters_agree(tp_p: int, tp_d: int) -> None:
    """Which D ranks end a P rank's lease is the inverse of which P ranks each D rank talks to."""
    talks = {(d, p) for d in range(tp_d) for p in contact_ranks(d, tp_d, tp_p)}
    ends = {(d, p) for p in range(tp_p) for d in reporting_ranks(p, tp_p, tp_d)}
    assert talks == ends
    assert {p for _, p in talks} == set(range(tp_p))  # every P rank hears from some D rank


def test_sizes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(LayoutMismatchError, match="one must divide the other"):
        contact_ranks(0, 3, 2)
