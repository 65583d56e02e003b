"""Mamba/GDN state pages move byte-exact: vLLM 0.34's state alignment, TP-replicated states, and
several state specs of different page sizes in one model.

vLLM 0.34 pads each state of a Mamba page to ``MambaSpec.state_alignment`` (16 for Mamba2 with
FlashInfer's ReplaySSM): ``MambaBase.bind_kv_cache`` binds each state at ``offset``, then moves
``offset`` on by ``round_up(nbytes, state_alignment)``. vLLM 0.32 and 0.33 have no such field and
pack the states one after the other (alignment 1). A ``tp_replicated`` state (Zaya's CCA
history, Qwen4Exp's short-conv "PLE" state) is held whole by every TP rank.

Everything here is built by vLLM's own code, as in ``test_layout_tp`` and ``vllm_caches``: specs
are vLLM's ``MambaSpec`` (shapes from ``MambaStateShapeCalculator``), grouped and placed by
``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` and viewed by ``allocate_kv_cache``;
the reference for where a state lies is the view vLLM's own ``MambaBase.bind_kv_cache`` binds
(``test_layout_tp.state_views``). P's states are written through those views, kvbridge plans
from what ``build_layout_spec`` describes on each side, the plan is applied with ``memmove``, and
D is checked through the same views: every moved state equals its source byte for byte, no other
byte of D changed (the alignment padding between states included), and each plan has the fewest
descriptors its bytes allow. A state is its own region with its unpadded size, so P and D of
different alignments pair state by state: the transfer converts one packing into the other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see the README: vLLM on the CPU)")

import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec

from kvbridge.adapters.vllm.layout import build_layout_spec
from kvbridge.core import Layout, LayoutError, check_compatible, plan_transfers
from kvbridge.core.tp import contact_ranks
from tests.adapters.vllm.test_layout_matrix import (
    ByteRuns,
    IdMap,
    apply_plan,
    byte_runs,
    first_difference,
    moved_blocks,
    request_block_ids,
    same_bytes,
)
from tests.adapters.vllm.test_layout_tp import (
    GlobalCache,
    conv_state_layout,
    expected_runs,
    layout_of,
    local_kv_heads,
    move_to_d_rank,
    rank_specs,
    source_rank,
    state_views,
)
from tests.adapters.vllm.vllm_caches import (
    BLOCK_SIZE,
    DTYPE,
    VllmCaches,
    allocate,
    distinct_words,
    element_addresses,
    kernel_block_sizes,
    make_kv_cache_config,
    twin,
)

#: Whether this vLLM has ``MambaSpec.state_alignment`` (0.34 and later).
HAS_ALIGNMENT = "state_alignment" in {f.name for f in dataclasses.fields(MambaSpec)}
NO_ALIGNMENT = "vLLM < 0.34 has no MambaSpec.state_alignment"
ALIGNMENTS = (1, 8, 16, 64)
P_SEED, D_SEED = 11, 22
HEAD_SIZE = 16
#: State shapes and dtypes whose byte sizes are no multiples of the alignments, by vLLM's
#: ``MambaStateShapeCalculator``: a GDN layer (conv ``(3, 10)`` bf16 = 60 bytes, ssm
#: ``(1, 4, 3)`` fp32 = 48) and a Mamba2 layer (conv ``(3, 11)`` bf16 = 66 bytes, ssm
#: ``(5, 1, 3)`` bf16 = 30). (An fp32 ssm state after 66 bytes could not be bound at alignment 1:
#: its view needs a 4-byte aligned offset.)
STATE_KINDS = {
    "gdn": (
        MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, num_k_heads=1, num_v_heads=1, head_k_dim=3, head_v_dim=4, conv_kernel_size=4
        ),
        (DTYPE, torch.float32),
        MambaAttentionBackendEnum.GDN_ATTN,
    ),
    "mamba2": (
        MambaStateShapeCalculator.mamba2_state_shape(
            1,
            intermediate_size=5,
            n_groups=1,
            num_heads=5,
            head_dim=1,
            state_size=3,
            conv_kernel=4,
        ),
        (DTYPE, DTYPE),
        MambaAttentionBackendEnum.MAMBA2,
    ),
}
#: A Zaya-like TP-replicated state (CCA: raw q/k history ``(heads * head_dim, history)`` and the
#: delayed value ``(delayed_dim,)``, both bf16: 90 and 14 bytes), the same on every rank.
REPLICATED_SHAPES = ((15, 3), (7,))
#: Qwen4Exp's PLE state: ``short_conv_state_shape(tp_world_size=1, ...)``, bf16 (480 bytes).
PLE_SHAPES = MambaStateShapeCalculator.short_conv_state_shape(
    tp_world_size=1, intermediate_size=40, conv_kernel=7
)


def alignment_args(alignment: int) -> dict[str, Any]:
    """A Mamba layer's spec arguments for ``alignment`` as vLLM 0.34's ``MambaBase`` gives them
    (``state_alignment``, and the block stride aligned alike); older vLLM: alignment 1 only."""
    if not HAS_ALIGNMENT:
        if alignment != 1:
            pytest.skip(NO_ALIGNMENT)
        return {}
    return {"state_alignment": alignment, "block_stride_alignment": alignment}


def round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def attention(heads: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=DTYPE
    )


def build(kind: str, layout: str, specs: dict[str, KVCacheSpec], tp: int = 1) -> VllmCaches:
    """One rank's caches from its layer specs, grouped, placed and viewed by vLLM.

    ``kind`` names the model for ``test_layout_tp`` (its KV heads)."""
    kv_config = make_kv_cache_config(kind, layout, specs=specs, tp_size=tp)
    sizes = kernel_block_sizes(kv_config, 1)
    return VllmCaches(kind, layout, 1, kv_config, allocate(kv_config, layout, sizes), sizes)


def is_state_layer(caches: VllmCaches, layer: str) -> bool:
    return isinstance(caches.layer_spec(layer), MambaSpec)


def write_states(caches: VllmCaches, layer: str, ids: list[int], seed: int) -> None:
    """Distinct bytes into the states of blocks ``ids`` of a layer, through vLLM's views."""
    for i, state in enumerate(state_views(caches, layer)):
        raw = state.view(torch.int8)[ids]
        words = distinct_words(raw.numel(), seed + 7919 * i).view(np.int8)
        state.view(torch.int8)[ids] = torch.from_numpy(words.copy()).reshape(raw.shape)


def copy_states(src: VllmCaches, dst: VllmCaches, moved: list[tuple[str, int, int]]) -> None:
    """State ``a`` of ``src`` into state ``b`` of ``dst``, through vLLM's views."""
    for layer, a, b in moved:
        for s, d in zip(state_views(src, layer), state_views(dst, layer), strict=True):
            d[b] = s[a]


def state_runs(p: VllmCaches, d: VllmCaches, moved: list[tuple[str, int, int]]) -> ByteRuns:
    """Every element of the moved states, P address to D address, read off vLLM's views."""
    src, dst, length = [], [], []
    for layer, a, b in moved:
        for ps, ds in zip(state_views(p, layer), state_views(d, layer), strict=True):
            assert ps[a].shape == ds[b].shape and ps.dtype == ds.dtype
            src.append(element_addresses(ps[a]))
            dst.append(element_addresses(ds[b]))
            length.append(np.full(ps[a].numel(), ps.element_size(), dtype=np.int64))
    return ByteRuns(np.concatenate(src), np.concatenate(dst), np.concatenate(length))


def joined(*runs: ByteRuns | None) -> ByteRuns | None:
    present = [r for r in runs if r is not None]
    if not present:
        return None
    return ByteRuns(
        np.concatenate([r.src for r in present]),
        np.concatenate([r.dst for r in present]),
        np.concatenate([r.length for r in present]),
    )


def same_groups(p: VllmCaches, d: VllmCaches) -> None:
    assert [g.layer_names for g in p.config.kv_cache_groups] == [
        g.layer_names for g in d.config.kv_cache_groups
    ], "vLLM grouped the layers differently on the two sides"


# --- a/b: state alignment, equal and different on P and D -------------------------------------


def aligned_specs(state: str, alignment: int, model: str) -> dict[str, KVCacheSpec]:
    """Two Mamba layers of kind ``state`` with ``alignment`` (``model`` ``"hybrid"``: beside two
    attention layers, the pages padded to the attention page as vLLM's platform hook pads them;
    ``"alone"``: a Mamba-only model, pages of vLLM's own content size)."""
    shapes, dtypes, mamba_type = STATE_KINDS[state]
    padded = attention().page_size_bytes if model == "hybrid" else None
    mamba = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=padded,
        mamba_type=mamba_type,
        mamba_cache_mode="align",
        **alignment_args(alignment),
    )
    if model == "alone":
        return {"m0": mamba, "m1": mamba}
    return {"attn0": attention(), "m0": mamba, "m1": mamba, "attn1": attention()}


def move_and_check(p: VllmCaches, d: VllmCaches) -> None:
    """Plan P -> D with kvbridge, apply it, and check D through vLLM's views."""
    same_groups(p, d)
    p.fill(P_SEED)
    d.fill(D_SEED)
    p_ids, d_ids = request_block_ids(p, seed=1), request_block_ids(d, seed=2)
    moved = moved_blocks(p, p_ids, d_ids)
    states = [m for m in moved if is_state_layer(p, m[0])]
    paged = [m for m in moved if not is_state_layer(p, m[0])]
    assert states, "the request holds no state"
    for i, layer in enumerate(sorted({layer for layer, _, _ in states})):
        write_states(p, layer, sorted({a for lay, a, _ in states if lay == layer}), 100 + i)
    expected = twin(d)
    expected.buffer.copy_(d.buffer)
    copy_states(p, expected, states)
    for layer, a, b in paged:
        expected.block(layer, b).copy_(p.block(layer, a))
    runs = joined(state_runs(p, d, states), byte_runs(p, d, paged) if paged else None)
    assert runs is not None

    p_layout = Layout(build_layout_spec(p.config, p.views))
    d_layout = Layout(build_layout_spec(d.config, d.views))
    check_compatible(p_layout, d_layout)
    check_compatible(d_layout, p_layout)
    plan = plan_transfers(p_layout, d_layout, p_ids, d_ids)
    p_before = p.buffer.clone()
    apply_plan(plan, p, d)

    for layer, a, b in states:
        for i, (ps, ds) in enumerate(
            zip(state_views(p, layer), state_views(d, layer), strict=True)
        ):
            assert same_bytes(ds[b], ps[a]), (
                f"layer {layer}: state {i} of D slot {b} is not P's {a}"
            )
    assert torch.equal(p.buffer, p_before), "the source buffer changed"
    assert torch.equal(d.buffer, expected.buffer), (
        "bytes of D outside the moved states changed: "
        + first_difference(d.buffer, expected.buffer)
    )
    assert plan.nbytes == runs.nbytes
    assert plan.count == runs.min_descriptors(), (
        f"{plan.count} descriptors, the minimum is {runs.min_descriptors()} "
        f"(unmerged {plan.unmerged})"
    )


@pytest.mark.parametrize("model", ["hybrid", "alone"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("state", sorted(STATE_KINDS))
@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_aligned_states_move_exactly(alignment: int, state: str, layout: str, model: str) -> None:
    specs = aligned_specs(state, alignment, model)
    p, d = build("attn4", layout, specs), build("attn4", layout, specs)
    # Where kvbridge puts each state is where vLLM's bind_kv_cache binds it: the ssm state at
    # the conv state's size rounded up to the alignment (GDN: 60 bytes -> 64 at 8, 16 and 64).
    shapes, dtypes, _ = STATE_KINDS[state]
    conv_bytes = nbytes_of(shapes[0], dtypes[0])
    spec = build_layout_spec(p.config, p.views)
    for layer in ("m0", "m1"):
        page = p.views[layer]
        tensors = {t.tensor: t for t in spec.tensors if t.layer_name == layer}
        bound = state_views(p, layer)
        assert sorted(tensors) == ["conv", "ssm"]
        assert tensors["ssm"].addr - page.data_ptr() == round_up(conv_bytes, alignment)
        for name, view in zip(("conv", "ssm"), bound, strict=True):
            assert tensors[name].addr == view.data_ptr()
            assert tensors[name].block_bytes == view[0].numel() * view.element_size()
            assert tensors[name].block_stride == view.stride(0) * view.element_size()
    move_and_check(p, d)


@pytest.mark.parametrize("alignment", [1, 64])
def test_a_page_shorter_than_the_padded_states_is_refused(alignment: int) -> None:
    """The page must hold what vLLM's ``state_content_size_bytes`` counts: every state padded
    to the alignment (GDN: 60 + 48 bytes at 1; 64 + 64 at 64)."""
    caches = build("attn4", "LBHNC", aligned_specs("gdn", alignment, "alone"))
    shapes, dtypes, _ = STATE_KINDS["gdn"]
    content = sum(round_up(nbytes_of(s, t), alignment) for s, t in zip(shapes, dtypes, strict=True))
    spec: Any = caches.layer_spec("m0")
    assert content == spec.page_size_bytes == caches.views["m0"].shape[-1]
    build_layout_spec(caches.config, {**caches.views, "m0": caches.views["m0"][..., :content]})
    short = {**caches.views, "m0": caches.views["m0"][..., : content - 1]}
    with pytest.raises(LayoutError, match=rf"states of {content} bytes.* exceed its page"):
        build_layout_spec(caches.config, short)


@pytest.mark.parametrize("model", ["hybrid", "alone"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("state", sorted(STATE_KINDS))
@pytest.mark.parametrize(("p_align", "d_align"), [(1, 16), (16, 1), (64, 8), (8, 64)])
def test_different_alignments_convert_exactly(
    p_align: int, d_align: int, state: str, layout: str, model: str
) -> None:
    """P and D pad their states differently: each state moves to where D binds it."""
    p = build("attn4", layout, aligned_specs(state, p_align, model))
    d = build("attn4", layout, aligned_specs(state, d_align, model))
    move_and_check(p, d)


# --- c/d: TP-replicated states, beside sharded attention and GDN ------------------------------


def replicated_layers(caches: VllmCaches) -> set[str]:
    return {
        layer
        for group in caches.config.kv_cache_groups
        for layer in group.layer_names
        if getattr(caches.layer_spec(layer), "tp_replicated", False)
    }


def tp_move_and_check(kind: str, ps: list[VllmCaches], ds: list[VllmCaches]) -> None:
    """Every D rank's blocks after one request from the P ranks (``plan_tp_transfers``).

    Sharded layers (attention heads, GDN channels and heads) hold the model's global cache as
    ``test_layout_tp`` fills it; a replicated state holds *different* bytes on each P rank (not
    what a model holds, which is the same state on every rank), so that D shows which P rank
    it came from: D rank ``d`` of ``td`` must hold exactly P rank ``d * tp // td``'s state (the
    replica rule of ``kvbridge.core.tp``), one of the P ranks it talks to."""
    tp, td = len(ps), len(ds)
    same_groups(ps[0], ds[0])
    replicated = replicated_layers(ps[0])
    assert replicated and replicated == replicated_layers(ds[0])
    g = GlobalCache(kind, ps[0])
    p_ids: IdMap = request_block_ids(ps[0], seed=1)  # TP ranks share block tables
    d_ids: IdMap = request_block_ids(ds[0], seed=2)
    moved = moved_blocks(ps[0], p_ids, d_ids)
    whole = [m for m in moved if m[0] in replicated]
    sharded = [m for m in moved if m[0] not in replicated]
    assert whole, "the request holds no replicated state"
    for rank, caches in enumerate(ps):
        caches.fill(P_SEED + rank)  # other blocks and padding: noise that must not move
        for group, spec in enumerate(caches.config.kv_cache_groups):
            held = [b for b in p_ids[group] if b]
            for i, layer in enumerate(spec.layer_names):
                if layer in replicated:
                    write_states(caches, layer, held, 1000 * (rank + 1) + i)
                else:
                    g.write(caches, tp, rank, layer, held, held)
    p_layouts = [layout_of(c, tp, r) for r, c in enumerate(ps)]
    p_before = [c.buffer.clone() for c in ps]
    for d_rank, d in enumerate(ds):
        d.fill(D_SEED + d_rank)
        source = source_rank(list(range(tp)), list(range(td)), d_rank)
        contacts = contact_ranks(d_rank, td, tp)
        assert source in contacts
        expected = twin(d)
        expected.buffer.copy_(d.buffer)
        for layer, a, b in sharded:
            g.write(expected, td, d_rank, layer, [b], [a])
        copy_states(ps[source], expected, whole)

        d_layout = layout_of(d, td, d_rank)
        plans = move_to_d_rank(p_layouts, d_layout, d_rank, p_ids, d_ids, ps, d, expected)
        for p_rank in range(tp):
            runs = joined(
                expected_runs(g, ps[p_rank], d, tp, td, d_rank, p_rank, sharded)
                if sharded
                else None,
                state_runs(ps[p_rank], d, whole) if p_rank == source else None,
            )
            plan = plans.get(p_rank)
            if runs is None:
                assert plan is None, f"P rank {p_rank} sends D rank {d_rank} what it needs not"
                continue
            assert plan is not None, f"P rank {p_rank} sends D rank {d_rank} nothing"
            assert plan.nbytes == runs.nbytes, f"P rank {p_rank} -> D rank {d_rank}"
            assert plan.count == runs.min_descriptors(), (
                f"P rank {p_rank} -> D rank {d_rank}: {plan.count} descriptors, the "
                f"minimum is {runs.min_descriptors()} (unmerged {plan.unmerged})"
            )
    for before, caches in zip(p_before, ps, strict=True):
        assert torch.equal(caches.buffer, before), "a source buffer changed"


def replicated_specs(tp: int, alignment: int) -> dict[str, KVCacheSpec]:
    """One rank's layers: 4 KV heads sharded as vLLM shards them, and two Zaya-like replicated
    state layers (the same shapes on every rank), their pages padded to the rank's attention
    page as vLLM's platform hook pads them."""
    attn = attention(local_kv_heads(4, tp))
    state = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=REPLICATED_SHAPES,
        dtypes=(DTYPE, DTYPE),
        page_size_padded=attn.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
        mamba_cache_mode="align",
        tp_replicated=True,
        **alignment_args(alignment),
    )
    return {"attn0": attn, "r0": state, "r1": state, "attn1": attn}


@pytest.mark.parametrize("alignment", [1, 16])
@pytest.mark.parametrize(("tp", "td"), [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2)])
def test_replicated_state_reaches_every_rank_once(tp: int, td: int, alignment: int) -> None:
    ps = [build("attn4", "LBHNC", replicated_specs(tp, alignment), tp) for _ in range(tp)]
    ds = [build("attn4", "LBHNC", replicated_specs(td, alignment), td) for _ in range(td)]
    tp_move_and_check("attn4", ps, ds)


def test_replicated_state_is_whole_on_every_rank() -> None:
    """Every rank describes the replicated state whole, one replica of ``tp_size``."""
    tp = 4
    for rank in range(tp):
        caches = build("attn4", "LBHNC", replicated_specs(tp, 1), tp)
        spec = layout_of(caches, tp, rank).spec
        states = [t for t in spec.tensors if t.layer_name in ("r0", "r1")]
        assert len(states) == 4
        for t in states:
            [shard] = t.shards or []
            assert (shard.start, shard.count, shard.unit_bytes) == (0, 1, t.block_bytes)
            assert (shard.replicas, shard.replica) == (tp, rank)


def qwen4exp_specs(kind: str, tp: int) -> dict[str, KVCacheSpec]:
    """One rank of a Qwen4Exp-like model: ``test_layout_tp``'s GDN model (sharded GDN layers
    and full attention) and one short-conv "PLE" layer with a ``tp_replicated`` MambaSpec of
    another page size (``get_mamba_specs_from_config``'s second spec). ``gdn_packed``: both
    Mamba specs unpadded (GDN 2816 bytes at TP 1, PLE 480); ``gdn``: both padded to the
    attention page, what vLLM's ``_align_hybrid_block_size`` does with the larger of the two."""
    specs = rank_specs(kind, tp)
    attn = specs["attn0"]
    assert isinstance(attn, FullAttentionSpec)
    ple = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=PLE_SHAPES,
        dtypes=(DTYPE,),
        page_size_padded=attn.page_size_bytes if kind == "gdn" else None,
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
        mamba_cache_mode="align",
        tp_replicated=True,
    )
    if kind == "gdn_packed":
        assert specs["gdn0"].page_size_bytes != ple.page_size_bytes
    return {**specs, "ple0": ple}


@pytest.mark.parametrize(("tp", "td"), [(1, 1), (2, 2), (1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("kind", ["gdn_packed", "gdn"])
def test_two_state_specs_of_different_page_sizes(kind: str, layout: str, tp: int, td: int) -> None:
    """A GDN MambaSpec and a replicated PLE MambaSpec of another page size in one model.

    vLLM (0.32, 0.33 and 0.34 alike) accepts the unpadded pair, refusing nothing. On the
    layer-outer LBHNC, ``unify_kv_cache_spec_page_size`` pads both Mamba pages to the attention
    page (8192 bytes at TP 1) and every layer gets a group of its own (the single PLE layer
    makes vLLM's group size 1). On the block-outermost BLHNC, ``_get_packed_kv_cache_groups``
    packs each kind's pages side by side in every block, unpadded, in three groups: the four
    GDN pages, the two attention pages, and the PLE page of 480 bytes. Padded as the platform
    hook pads them (``gdn``), every page is the attention page and every layer its own group on
    both layouts. Whatever vLLM did, the PLE layer is alone in its group
    (its spec differs in ``tp_replicated``), as vLLM's NIXL worker expects."""
    with conv_state_layout(kind):
        ps = [build(kind, layout, qwen4exp_specs(kind, tp), tp) for _ in range(tp)]
        ds = [build(kind, layout, qwen4exp_specs(kind, td), td) for _ in range(td)]
        [ple_group] = [g for g in ps[0].config.kv_cache_groups if "ple0" in g.layer_names]
        assert ple_group.layer_names == ["ple0"]
        tp_move_and_check(kind, ps, ds)
