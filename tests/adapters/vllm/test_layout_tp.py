"""vLLM caches of different TP sizes move their TP slices byte-exact, with the fewest descriptors.

For each model kind x physical layout x (P TP size, D TP size), vLLM's own code builds every
rank's cache: the per-rank specs are what vLLM gives a rank of that TP size (KV heads from
``ModelConfig.get_num_kv_heads``, GDN state shapes from ``MambaStateShapeCalculator``), grouped,
placed and viewed by ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` /
``allocate_kv_cache``. Every P rank is filled, through vLLM's views, with the model's *global*
cache: random bytes per (layer, block, global KV head or conv channel or ssm head, token), each
rank holding the slice vLLM's sharding gives it (``QKVParallelLinear``'s heads, GDN's ``[q|k|v]``
sub-projections). Then, for every D rank, kvbridge plans (``plan_tp_transfers``) from the layouts
``build_layout_spec`` describes, the plans are applied with ``memmove``, and D is checked against
the global cache alone: every moved block holds what the model says the rank holds, no other byte
changed, and each source rank's plan has the fewest descriptors its bytes allow.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see the README: vLLM on the CPU)")

import msgspec
import torch
from vllm.config import ModelConfig, ParallelConfig
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvbridge.adapters.vllm.layout import build_layout_spec
from kvbridge.adapters.vllm.transpose import transpose_received
from kvbridge.core import Layout, LayoutError, LayoutSpec, check_compatible, plan_transfers
from kvbridge.core.tp import contact_ranks, plan_tp_reads, plan_tp_transfers
from kvbridge.core.transpose import received_transposes
from tests.adapters.vllm.test_layout_matrix import (
    ByteRuns,
    IdMap,
    apply_plan,
    first_difference,
    moved_blocks,
    request_block_ids,
)
from tests.adapters.vllm.vllm_caches import (
    BLOCK_SIZE,
    DTYPE,
    NUM_BLOCKS,
    SLIDING_WINDOW,
    VllmCaches,
    allocate,
    distinct_words,
    element_addresses,
    kernel_block_sizes,
    make_kv_cache_config,
    twin,
)

HEAD_SIZE = 16
#: The model's KV heads, all ranks together (``None``: MLA).
TOTAL_KV_HEADS = {
    "attn4": 4, "attn2": 2, "sliding": 4, "mla": None, "gdn": 4, "gdn_ds": 4, "gdn_packed": 4,
}  # fmt: skip
KINDS = tuple(TOTAL_KV_HEADS)
#: A Qwen3-Next-like gated delta net, vLLM's ``gated_delta_net_state_shape`` arguments.
GDN = {"num_k_heads": 4, "num_v_heads": 8, "head_k_dim": 8, "head_v_dim": 8}
GDN_KERNEL = 4
KEY_DIM = GDN["num_k_heads"] * GDN["head_k_dim"]
VALUE_DIM = GDN["num_v_heads"] * GDN["head_v_dim"]
#: The head-major layouts (a KV head's slice of a block is one run, or one tensor per head).
LAYOUTS = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")
#: vLLM 0.32 under LHBNC overlays GDN pages on other block ids of the attention group
#: (``test_layout_matrix.ALIASING``): kvbridge refuses those layouts at any TP size; vLLM
#: itself refuses BHLNC for Mamba pages packed beside attention pages.
SKIPPED = {("LHBNC", k) for k in ("gdn", "gdn_ds", "gdn_packed")} | {("BHLNC", "gdn_packed")}
#: Every pair of head-major layouts: those that differ only in where a layer's block sits (the
#: same block format), and those that differ in where each head's ``[N, C]`` sits (whole
#: ``[H, N, C]`` blocks on one side, a region per head on the other), moved head by head.
MIXED = tuple((p, d) for p in LAYOUTS for d in LAYOUTS if p != d)
TP_PAIRS = ((1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2))
P_SEED, D_SEED = 11, 22

CASES = [
    pytest.param(kind, layout, layout, tp, td, ratio, id=f"{layout}-{kind}-tp{tp}to{td}-r{ratio}")
    for kind in KINDS
    for layout in LAYOUTS
    if (layout, kind) not in SKIPPED
    for tp, td in TP_PAIRS
    for ratio in ((1, 2) if layout == "LBHNC" or (layout, kind) == ("LHBNC", "mla") else (1,))
] + [
    pytest.param(kind, p, d, tp, td, 1, id=f"{p}-to-{d}-{kind}-tp{tp}to{td}")
    for kind in ("attn4", "attn2", "mla", "gdn")
    for p, d in MIXED
    if (p, kind) not in SKIPPED and (d, kind) not in SKIPPED
    for tp, td in ((1, 2), (2, 1), (4, 2))
]


# --- what vLLM gives each rank ----------------------------------------------------------------


@functools.cache
def local_kv_heads(total: int, tp: int) -> int:
    """KV heads per rank, by vLLM's own ``ModelConfig.get_num_kv_heads``."""
    model = SimpleNamespace(
        use_mla=False, model_arch_config=SimpleNamespace(total_num_kv_heads=total)
    )
    return int(ModelConfig.get_num_kv_heads(model, ParallelConfig(tensor_parallel_size=tp)))  # type: ignore[arg-type]


def held_heads(total: int, tp: int, rank: int) -> list[int]:
    """Global KV heads of a rank (``QKVParallelLinear``: replicated when fewer than ranks)."""
    if total >= tp:
        per = total // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total)]


def conv_channels(tp: int, rank: int) -> npt.NDArray[np.int64]:
    """Global conv channels (``[q | k | v]`` of the whole layer) of a rank's ``[q | k | v]``."""
    q, v = KEY_DIM // tp, VALUE_DIM // tp
    return np.concatenate(
        [
            np.arange(rank * q, (rank + 1) * q),
            KEY_DIM + np.arange(rank * q, (rank + 1) * q),
            2 * KEY_DIM + np.arange(rank * v, (rank + 1) * v),
        ]
    )


def ssm_heads(tp: int, rank: int) -> list[int]:
    per = GDN["num_v_heads"] // tp
    return list(range(rank * per, (rank + 1) * per))


def rank_specs(kind: str, tp: int) -> dict[str, KVCacheSpec]:
    """Layer name -> spec of one rank of TP size ``tp``, as the model runner gives them."""
    if kind == "mla":  # the latent is the same on every rank
        mla = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=72, dtype=DTYPE)
        return {f"mla{i}": mla for i in range(3)}
    total = TOTAL_KV_HEADS[kind]
    assert total is not None
    heads = local_kv_heads(total, tp)
    attn = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=DTYPE
    )
    if kind in ("attn4", "attn2"):
        return {f"attn{i}": attn for i in range(3)}
    if kind == "sliding":
        swa = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=heads,
            head_size=HEAD_SIZE,
            dtype=DTYPE,
            sliding_window=SLIDING_WINDOW,
        )
        return {"attn0": attn, "swa0": swa, "attn1": attn, "swa1": swa}
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, conv_kernel_size=GDN_KERNEL, **GDN
    )
    # "gdn": pages padded to the attention page (vLLM's ``_align_hybrid_block_size``);
    # "gdn_packed": unpadded, which vLLM pads or packs side by side in each block itself.
    padded = None if kind == "gdn_packed" else attn.page_size_bytes
    gdn = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=shapes,
        dtypes=(DTYPE, torch.float32),
        page_size_padded=padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    return {"gdn0": gdn, "gdn1": gdn, "attn0": attn, "gdn2": gdn, "gdn3": gdn, "attn1": attn}


@contextmanager
def conv_state_layout(kind: str) -> Iterator[str]:
    """vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT`` for the kind (``gdn_ds``: DS, else SD)."""
    wanted = "DS" if kind == "gdn_ds" else "SD"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SSM_CONV_STATE_LAYOUT", wanted)
        mamba_utils.get_conv_state_layout.cache_clear()
        try:
            assert mamba_utils.get_conv_state_layout() == wanted
            yield wanted
        finally:
            mamba_utils.get_conv_state_layout.cache_clear()


@functools.cache
def rank_config(kind: str, layout: str, tp: int) -> KVCacheConfig:
    """vLLM's grouping and placement of one rank's layers (every rank of a size alike)."""
    return make_kv_cache_config(kind, layout, specs=rank_specs(kind, tp), tp_size=tp)


def build_rank(kind: str, layout: str, tp: int, ratio: int) -> VllmCaches:
    kv_config = rank_config(kind, layout, tp)
    sizes = kernel_block_sizes(kv_config, ratio)
    return VllmCaches(kind, layout, ratio, kv_config, allocate(kv_config, layout, sizes), sizes)


def state_views(caches: VllmCaches, layer: str) -> tuple[torch.Tensor, ...]:
    """A Mamba layer's states as the layer binds them (vLLM's ``MambaBase.bind_kv_cache``)."""
    spec: Any = caches.layer_spec(layer)
    fake = SimpleNamespace(
        get_state_shape=lambda: spec.shapes,
        get_state_dtype=lambda: spec.dtypes,
        state_alignment=getattr(spec, "state_alignment", 1),  # vLLM 0.34 pads each state to it
    )
    MambaBase.bind_kv_cache(fake, caches.views[layer])  # type: ignore[arg-type]
    return tuple(fake.kv_cache)


def layout_of(caches: VllmCaches, tp: int, rank: int) -> Layout:
    total = TOTAL_KV_HEADS[caches.kind]
    return Layout(
        build_layout_spec(
            caches.config,
            caches.views,
            tp_rank=rank,
            tp_size=tp,
            total_num_kv_heads=total,
            engine_layout=caches.layout,
        )
    )


# --- the model's global cache, and which rank holds what -------------------------------------


def _ints(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.int8, 2: torch.int16, 4: torch.int32}[
        torch.empty((), dtype=dtype).element_size()
    ]


class GlobalCache:
    """The whole model's cache contents, per layer: random values per global unit and token."""

    def __init__(self, kind: str, views_of: VllmCaches) -> None:
        self.kind = kind
        self.paged: dict[str, npt.NDArray[Any]] = {}  # [blocks, heads, tokens, C]
        self.conv: dict[str, npt.NDArray[Any]] = {}  # [blocks, state_len, channels]
        self.ssm: dict[str, npt.NDArray[Any]] = {}  # [blocks, heads, v_dim, k_dim]
        for seed, (layer, view) in enumerate(sorted(views_of.views.items()), start=1000):
            spec: Any = views_of.layer_spec(layer)
            if isinstance(spec, MambaSpec):
                rows = GDN_KERNEL - 1
                self.conv[layer] = _random(
                    (NUM_BLOCKS, rows, 2 * KEY_DIM + VALUE_DIM), np.int16, seed
                )
                shape = (NUM_BLOCKS, GDN["num_v_heads"], GDN["head_v_dim"], GDN["head_k_dim"])
                self.ssm[layer] = _random(shape, np.int32, seed + 500)
            else:
                heads = TOTAL_KV_HEADS[kind] or 1
                shape = (NUM_BLOCKS, heads, BLOCK_SIZE, int(view.shape[-1]))
                self.paged[layer] = _random(shape, np.int16, seed)

    def heads(self, tp: int, rank: int) -> list[int]:
        total = TOTAL_KV_HEADS[self.kind]
        return [0] if total is None else held_heads(total, tp, rank)

    def write(
        self, caches: VllmCaches, tp: int, rank: int, layer: str, dst: list[int], src: list[int]
    ) -> None:
        """Write the global blocks ``src`` of a layer, as rank ``rank`` holds them, into its
        blocks ``dst``, through vLLM's views."""
        if layer in self.paged:
            view = caches.views[layer]
            r = caches.group_ratio(caches.group_of(layer))
            local = self.paged[layer][src][:, self.heads(tp, rank)]  # [n, H, tokens, C]
            n, h, _, c = local.shape
            kernel = local.reshape(n, h, r, BLOCK_SIZE // r, c).transpose(0, 2, 1, 3, 4)
            blocks = view.view(_ints(view.dtype)).unflatten(0, (NUM_BLOCKS, r))
            blocks[dst] = torch.from_numpy(np.ascontiguousarray(kernel))
            return
        conv, ssm = state_views(caches, layer)
        local_conv = self.conv[layer][src][:, :, conv_channels(tp, rank)]
        if conv.shape[1] != local_conv.shape[1]:  # DS: [channels, state_len]
            local_conv = local_conv.transpose(0, 2, 1)
        conv.view(torch.int16)[dst] = torch.from_numpy(np.ascontiguousarray(local_conv))
        local_ssm = self.ssm[layer][src][:, ssm_heads(tp, rank)]
        ssm.view(torch.int32)[dst] = torch.from_numpy(np.ascontiguousarray(local_ssm))

    def fill(self, caches: VllmCaches, tp: int, rank: int, ids: IdMap) -> None:
        """Write the request's blocks of every layer (only those: groups overlay one buffer,
        a block id belongs to one group at a time)."""
        for group, spec in enumerate(caches.config.kv_cache_groups):
            held = [b for b in ids[group] if b]
            for layer in spec.layer_names:
                self.write(caches, tp, rank, layer, held, held)


def _random(shape: tuple[int, ...], dtype: type[np.generic], seed: int) -> npt.NDArray[Any]:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return distinct_words(nbytes, seed).view(dtype).reshape(shape)


def source_rank(holders_p: list[int], holders_d: list[int], d: int) -> int:
    """Which P rank serves a unit to D rank ``d``: D's replica ``j`` of ``J`` reads P's
    replica ``j * I // J`` of ``I`` (the one holder among the P ranks D rank ``d`` talks to)."""
    return holders_p[holders_d.index(d) * len(holders_p) // len(holders_d)]


def expected_runs(
    g: GlobalCache,
    p: VllmCaches,
    d: VllmCaches,
    tp: int,
    td: int,
    d_rank: int,
    p_rank: int,
    moved: list[tuple[str, int, int]],
) -> ByteRuns | None:
    """Every element P rank ``p_rank`` sends D rank ``d_rank``, P address to D address."""
    src: list[npt.NDArray[np.int64]] = []
    dst: list[npt.NDArray[np.int64]] = []
    length: list[npt.NDArray[np.int64]] = []

    def add(ps: torch.Tensor, ds: torch.Tensor) -> None:
        assert ps.shape == ds.shape
        src.append(element_addresses(ps))
        dst.append(element_addresses(ds))
        length.append(np.full(ps.numel(), ps.element_size(), dtype=np.int64))

    for layer, a, b in moved:
        if layer in g.paged:
            p_heads, d_heads = g.heads(tp, p_rank), g.heads(td, d_rank)
            for gh in d_heads:
                holders_p = [r for r in range(tp) if gh in g.heads(tp, r)]
                holders_d = [r for r in range(td) if gh in g.heads(td, r)]
                if source_rank(holders_p, holders_d, d_rank) == p_rank:
                    add(
                        p.block(layer, a)[:, p_heads.index(gh)],
                        d.block(layer, b)[:, d_heads.index(gh)],
                    )
            continue
        p_conv, p_ssm = state_views(p, layer)
        d_conv, d_ssm = state_views(d, layer)
        p_ch, d_ch = list(conv_channels(tp, p_rank)), list(conv_channels(td, d_rank))
        both = [c for c in d_ch if c in p_ch]
        if both:  # addresses of the channels, picked out of the views' addresses
            pi, di = [p_ch.index(c) for c in both], [d_ch.index(c) for c in both]
            p_addr = element_addresses(p_conv[a]).reshape(p_conv[a].shape)
            d_addr = element_addresses(d_conv[b]).reshape(d_conv[b].shape)
            if p_conv.shape[1] == len(p_ch):  # DS: [channels, state_len]
                src.append(p_addr[pi].reshape(-1))
                dst.append(d_addr[di].reshape(-1))
            else:
                src.append(p_addr[:, pi].reshape(-1))
                dst.append(d_addr[:, di].reshape(-1))
            length.append(np.full(src[-1].size, p_conv.element_size(), dtype=np.int64))
        p_h, d_h = ssm_heads(tp, p_rank), ssm_heads(td, d_rank)
        for h in (h for h in d_h if h in p_h):
            add(p_ssm[a][p_h.index(h)], d_ssm[b][d_h.index(h)])
    if not src:
        return None
    return ByteRuns(np.concatenate(src), np.concatenate(dst), np.concatenate(length))


def expected_rank(
    g: GlobalCache, d: VllmCaches, td: int, d_rank: int, p_ids: IdMap, d_ids: IdMap
) -> VllmCaches:
    """D rank ``d_rank`` of ``td`` as it must be after the request: a copy of it with its heads
    of every moved block written from the model's global cache."""
    expected = twin(d)
    expected.buffer.copy_(d.buffer)
    for group, spec in enumerate(d.config.kv_cache_groups):
        pairs = [(a, b) for a, b in zip(p_ids[group], d_ids[group], strict=True) if a and b]
        for layer in spec.layer_names:
            g.write(expected, td, d_rank, layer, [b for _, b in pairs], [a for a, _ in pairs])
    return expected


def move_to_d_rank(
    p_layouts: list[Layout],
    d_layout: Layout,
    d_rank: int,
    p_ids: IdMap,
    d_ids: IdMap,
    ps: list[VllmCaches],
    d: VllmCaches,
    expected: VllmCaches,
) -> dict[int, Any]:
    """Plan every P rank's part of D rank ``d_rank``'s request and apply it; D must then hold
    ``expected``. What the control plane does is checked on the way: handshake checks with the
    P ranks D talks to (both ways), and planning from those alone gives the same plans."""
    tp, td = len(p_layouts), d_layout.spec.tp_size
    plans = plan_tp_transfers(p_layouts, d_layout, p_ids, d_ids)
    contacts = contact_ranks(d_rank, td, tp)
    for q in contacts:
        check_compatible(p_layouts[q], d_layout)
        check_compatible(d_layout, p_layouts[q])
    mine = plan_tp_reads({q: p_layouts[q] for q in contacts}, d_layout, p_ids, d_ids)
    assert {q: (m.count, m.nbytes) for q, m in mine.items()} == {
        q: (m.count, m.nbytes) for q, m in plans.items()
    }
    for p_rank, plan in plans.items():
        apply_plan(plan, ps[p_rank], d)
    assert torch.equal(d.buffer, expected.buffer), (
        f"D rank {d_rank}: {first_difference(d.buffer, expected.buffer)}"
    )
    return plans


def _same_groups(p: VllmCaches, d: VllmCaches) -> None:
    assert [g.layer_names for g in p.config.kv_cache_groups] == [
        g.layer_names for g in d.config.kv_cache_groups
    ], "vLLM grouped the layers differently at the two TP sizes"


# --- the checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "p_layout", "d_layout", "tp", "td", "ratio"), CASES)
def test_tp_transfer_is_exact_and_minimal(
    kind: str, p_layout: str, d_layout: str, tp: int, td: int, ratio: int
) -> None:
    with conv_state_layout(kind):
        ps = [build_rank(kind, p_layout, tp, ratio) for _ in range(tp)]
        ds = [build_rank(kind, d_layout, td, ratio) for _ in range(td)]
        _same_groups(ps[0], ds[0])
        g = GlobalCache(kind, ps[0])
        p_ids: IdMap = request_block_ids(ps[0], seed=1)  # TP ranks share block tables
        d_ids: IdMap = request_block_ids(ds[0], seed=2)
        for rank, caches in enumerate(ps):
            caches.fill(P_SEED)  # padding and other blocks: noise that must not move
            g.fill(caches, tp, rank, p_ids)
        p_layouts = [layout_of(c, tp, r) for r, c in enumerate(ps)]
        moved = moved_blocks(ps[0], p_ids, d_ids)
        p_before = [c.buffer.clone() for c in ps]
        for d_rank, d in enumerate(ds):
            d.fill(D_SEED + d_rank)
            expected = expected_rank(g, d, td, d_rank, p_ids, d_ids)
            d_layout = layout_of(d, td, d_rank)
            plans = move_to_d_rank(p_layouts, d_layout, d_rank, p_ids, d_ids, ps, d, expected)
            for p_rank in range(tp):
                runs = expected_runs(g, ps[p_rank], d, tp, td, d_rank, p_rank, moved)
                plan = plans.get(p_rank)
                if runs is None:
                    assert plan is None, f"P rank {p_rank} sends D rank {d_rank} what it needs not"
                    continue
                assert plan is not None, f"P rank {p_rank} sends D rank {d_rank} nothing"
                assert plan.nbytes == runs.nbytes
                assert plan.count == runs.min_descriptors(), (
                    f"P rank {p_rank} -> D rank {d_rank}: {plan.count} descriptors, the "
                    f"minimum is {runs.min_descriptors()} (unmerged {plan.unmerged})"
                )
        for before, caches in zip(p_before, ps, strict=True):
            assert torch.equal(caches.buffer, before), "a source buffer changed"


def _bare(spec: LayoutSpec) -> Layout:
    """The layout without shards: what ``build_layout_spec`` described before it had them."""
    tensors = [msgspec.structs.replace(t, shards=msgspec.UNSET) for t in spec.tensors]
    return Layout(msgspec.structs.replace(spec, tensors=tensors))


EQUAL_CASES = [
    pytest.param(kind, layout, tp, id=f"{layout}-{kind}-tp{tp}")
    for kind in KINDS
    for layout in (*LAYOUTS, "LBNHC", "BLNHC")
    if (layout, kind) not in SKIPPED
    for tp in (1, 2)
]


@pytest.mark.parametrize(("kind", "layout", "tp"), EQUAL_CASES)
def test_equal_tp_plans_as_without_shards(kind: str, layout: str, tp: int) -> None:
    """Between equal TP sizes each D rank reads its own P rank, with exactly today's plan."""
    with conv_state_layout(kind):
        ps = [build_rank(kind, layout, tp, 1) for _ in range(tp)]
        ds = [build_rank(kind, layout, tp, 1) for _ in range(tp)]
        p_ids, d_ids = request_block_ids(ps[0], seed=1), request_block_ids(ds[0], seed=2)
        p_layouts = [layout_of(c, tp, r) for r, c in enumerate(ps)]
        for rank, d in enumerate(ds):
            d_layout = layout_of(d, tp, rank)
            assert all(t.shards for t in d_layout.spec.tensors), "a tensor carries no shards"
            plans = plan_tp_transfers(p_layouts, d_layout, p_ids, d_ids)
            today = plan_transfers(_bare(p_layouts[rank].spec), _bare(d_layout.spec), p_ids, d_ids)
            assert list(plans) == [rank]
            for field in ("src", "dst", "lengths"):
                assert np.array_equal(getattr(plans[rank], field), getattr(today, field))


HEAD_MAJOR_MESSAGE = "configure a head-major KV cache layout on both sides (vLLM's LBHNC or LHBNC)"


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize(
    ("kind", "tp", "td"), [("attn4", *p) for p in TP_PAIRS] + [("attn2", 1, 4)]
)
def test_token_major_layouts_are_refused_across_tp(
    kind: str, layout: str, tp: int, td: int
) -> None:
    """``[N, H, C]`` blocks interleave heads per token: a head slice is no run of a block (a
    rank's one head of several too: its block reads as a slice of the model's ``[N, H, C]``)."""
    ps = [build_rank(kind, layout, tp, 1) for _ in range(tp)]
    d = build_rank(kind, layout, td, 1)
    p_layouts = [layout_of(c, tp, r) for r, c in enumerate(ps)]
    p_ids, d_ids = request_block_ids(ps[0], seed=1), request_block_ids(d, seed=2)
    with pytest.raises(LayoutError, match=r"heads interleaved per token") as err:
        plan_tp_transfers(p_layouts, layout_of(d, td, 0), p_ids, d_ids)
    assert HEAD_MAJOR_MESSAGE in str(err.value)


@pytest.mark.parametrize(
    ("p_layout", "d_layout"),
    [("LBNHC", "LBHNC"), ("LBHNC", "LBNHC"), ("LBNHC", "LHBNC"), ("LHBNC", "BLNHC"),
     ("BLNHC", "BHLNC")],
)  # fmt: skip
def test_token_major_against_head_major_at_equal_tp_is_transposed_exactly(
    p_layout: str, d_layout: str
) -> None:
    """TP 2 on both sides: each D rank reads its P rank's blocks in P's order and, once its
    received blocks are permuted, holds exactly its heads of the model's cache."""
    tp = 2
    ps = [build_rank("attn4", p_layout, tp, 1) for _ in range(tp)]
    ds = [build_rank("attn4", d_layout, tp, 1) for _ in range(tp)]
    g = GlobalCache("attn4", ps[0])
    p_ids, d_ids = request_block_ids(ps[0], seed=1), request_block_ids(ds[0], seed=2)
    for rank, caches in enumerate(ps):
        caches.fill(P_SEED)
        g.fill(caches, tp, rank, p_ids)
    p_layouts = [layout_of(c, tp, r) for r, c in enumerate(ps)]
    for d_rank, d in enumerate(ds):
        d.fill(D_SEED + d_rank)
        expected = expected_rank(g, d, tp, d_rank, p_ids, d_ids)
        d_layout_ = layout_of(d, tp, d_rank)
        plans = plan_tp_transfers(p_layouts, d_layout_, p_ids, d_ids)
        assert sorted(plans) == [d_rank]
        apply_plan(plans[d_rank], ps[d_rank], d)
        transposes = received_transposes(p_layouts[d_rank], d_layout_, p_ids, d_ids)
        assert transposes, "the pair needs its blocks permuted"
        transpose_received(d.views, [s.layer_names for s in d.config.kv_cache_groups], transposes)
        assert torch.equal(d.buffer, expected.buffer), (
            f"D rank {d_rank}: {first_difference(d.buffer, expected.buffer)}"
        )


@pytest.mark.parametrize(("p_layout", "d_layout"), [("LBNHC", "LBHNC"), ("LHBNC", "BLNHC")])
@pytest.mark.parametrize(("tp", "td"), [(1, 2), (2, 1)])
def test_token_major_against_head_major_is_refused_across_tp(
    p_layout: str, d_layout: str, tp: int, td: int
) -> None:
    """Transposed on receive only between equal TP sizes: across them the refusal says why and
    names the head-major layouts."""
    ps = [build_rank("attn4", p_layout, tp, 1) for _ in range(tp)]
    d = build_rank("attn4", d_layout, td, 1)
    p_layouts = [layout_of(c, tp, r) for r, c in enumerate(ps)]
    p_ids, d_ids = request_block_ids(ps[0], seed=1), request_block_ids(d, seed=2)
    with pytest.raises(LayoutError, match="only between equal TP sizes") as err:
        plan_tp_transfers(p_layouts, layout_of(d, td, 0), p_ids, d_ids)
    assert "LBHNC, BLHNC, LHBNC, BHLNC" in str(err.value)


def test_without_total_heads_a_single_replicated_head_carries_no_shards() -> None:
    """At TP 4 a rank of a 2-head model holds 1 head, which could be any replica: without the
    model's count the layer carries no shards (moves only between equal TP sizes)."""
    caches = build_rank("attn2", "LBHNC", 4, 1)
    spec = build_layout_spec(caches.config, caches.views, tp_rank=1, tp_size=4)
    assert not any(t.shards for t in spec.tensors)
    given = build_layout_spec(
        caches.config, caches.views, tp_rank=1, tp_size=4, total_num_kv_heads=2
    )
    [shard] = given.tensors[0].shards or []
    assert (shard.start, shard.count, shard.replicas, shard.replica) == (0, 1, 2, 1)
    # Several heads per rank tell the count alone.
    wide = build_rank("attn4", "LBHNC", 2, 1)
    [shard] = (
        build_layout_spec(wide.config, wide.views, tp_rank=1, tp_size=2).tensors[0].shards or []
    )
    assert (shard.start, shard.count, shard.replicas) == (2, 2, 1)


def test_per_head_tensors_are_named_by_global_head() -> None:
    caches = build_rank("attn4", "LHBNC", 2, 1)
    spec = build_layout_spec(caches.config, caches.views, tp_rank=1, tp_size=2)
    names = sorted({t.tensor for t in spec.tensors})
    assert names == ["h2", "h3"]
    assert all(t.shards and t.shards[0].start == int(t.tensor[1:]) for t in spec.tensors)


def test_state_kinds_without_a_known_split_carry_no_shards() -> None:
    """Mamba2's ``[x | B | C]`` (groups extended when ``n_groups`` < TP) and Mamba1 carry no
    shards, so they move only between equal TP sizes; a ``tp_replicated`` state is whole on
    every rank."""
    from kvbridge.adapters.vllm.layout import _state_shards

    shapes, dtypes = ((3, 96), (4, 8, 16)), (DTYPE, torch.float32)
    sizes = [3 * 96 * 2, 4 * 8 * 16 * 4]
    for mamba_type in (MambaAttentionBackendEnum.MAMBA2, MambaAttentionBackendEnum.MAMBA1):
        spec = MambaSpec(block_size=BLOCK_SIZE, shapes=shapes, dtypes=dtypes, mamba_type=mamba_type)
        assert _state_shards(spec, sizes, 1, 2, "SD") is None
    replicated = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=shapes,
        dtypes=dtypes,
        tp_replicated=True,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    shards = _state_shards(replicated, sizes, 1, 2, "SD")
    assert shards is not None
    assert [(s.count, s.unit_bytes, s.replicas, s.replica) for [s] in shards] == [
        (1, size, 2, 1) for size in sizes
    ]
