"""Every physical layout vLLM can allocate moves byte-exact, with the fewest descriptors.

For each layout x model kind x kernel ratio, vLLM's own code builds a prefill (P) and a decode
(D) cache; kvbridge plans moving fragmented block ids from P to D; the plan is applied with
``memmove`` (then, between a token-major and a head-major side, D's received blocks permuted)
and checked through vLLM's views alone: every moved logical block of D equals P's, no other
byte of D changed, and the descriptor count is the number of maximal runs contiguous on both
sides, computed here from element addresses without kvbridge. Combinations vLLM itself refuses
are checked to be refused by vLLM; the combinations where vLLM's block ids alias across cache
groups are checked to be refused by kvbridge.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see the README: vLLM on the CPU)")

import torch

from kvbridge.adapters.vllm.layout import build_layout_spec
from kvbridge.adapters.vllm.transpose import transpose_received
from kvbridge.core import Layout, TransferPlan, check_compatible, plan_transfers
from kvbridge.core.errors import LayoutError
from kvbridge.core.transpose import received_transposes
from tests.adapters.vllm.vllm_caches import (
    BLOCK_SIZE,
    KINDS,
    LAYOUTS,
    NUM_BLOCKS,
    SLIDING_WINDOW,
    VllmCaches,
    VllmRefused,
    build_caches,
    distinct_words,
    element_addresses,
    twin,
)

RATIOS = (1, 2)
#: Logical blocks the request holds in each paged full-attention group.
REQUEST_BLOCKS = 6
P_SEED, D_SEED = 11, 22

CASES = [
    pytest.param(layout, kind, ratio, id=f"{layout}-{kind}-r{ratio}")
    for layout in LAYOUTS
    for kind in KINDS
    for ratio in RATIOS
]
#: Layouts whose kernel blocks keep each head's tokens together (whole, or one region per head)
#: and those that keep each token's heads together: a pair across the two moves in P's order and
#: D transposes the received blocks; within a family every pair moves exactly as it lies.
HEAD_MAJOR = {"LBHNC", "BLHNC", "LHBNC", "BHLNC"}
TOKEN_MAJOR = {"LBNHC", "BLNHC"}
MIXED_CASES = [
    pytest.param(p, d, kind, ratio, id=f"{p}-to-{d}-{kind}-r{ratio}")
    for p in LAYOUTS
    for d in LAYOUTS
    if p != d
    for kind in KINDS
    for ratio in RATIOS
]

IdMap = dict[int, list[int]]


BLOCK_OUTERMOST = {"BLHNC", "BLNHC", "BHLNC"}
#: Layout and kind where vLLM 0.32's block ids of one group overlay other ids of another group.
ALIASING = {("LHBNC", "gdn"), ("LHBNC", "gdn_packed")}


def vllm_refuses(layout: str, kind: str, ratio: int) -> bool:
    """What vLLM 0.32 refuses to allocate: kernel blocks split out of pages that are not dense
    (block-outermost layouts, and LHBNC's head slices unless there is one head), and BHLNC for
    pages of mixed sizes packed side by side."""
    split_refused = layout in BLOCK_OUTERMOST or (layout == "LHBNC" and kind != "mla")
    return (ratio > 1 and split_refused) or (layout, kind) == ("BHLNC", "gdn_packed")


def _build(kind: str, layout: str, ratio: int, device: str = "cpu") -> VllmCaches | None:
    """vLLM's caches, or ``None`` after checking that vLLM refuses them as documented."""
    if vllm_refuses(layout, kind, ratio):
        with pytest.raises(VllmRefused):
            build_caches(kind, layout, ratio, device=device)
        return None
    return build_caches(kind, layout, ratio, device=device)


def request_block_ids(caches: VllmCaches, seed: int) -> IdMap:
    """Fragmented block ids per group, as vLLM's manager would hand a request.

    Ids are never 0 (the null block) and distinct across groups, whose pages overlay one
    buffer; an id is also passed over when its bytes in its group meet bytes another group's
    block of the request already holds (vLLM 0.32 lets that happen under LHBNC, see
    ``test_vllm_block_ids_own_disjoint_bytes``). Full-attention groups get ``REQUEST_BLOCKS``
    ids, two of them consecutive and the rest scattered; a sliding-window group gets null
    placeholders for the blocks outside its window and real ids for the last
    ``ceil(window / block) + 1``; a Mamba group gets placeholders and one real state slot at
    the end (``mamba_cache_mode="align"``).
    """
    rng = np.random.default_rng(seed)
    order = [int(b) for b in rng.permutation(np.arange(1, NUM_BLOCKS))]
    held = np.zeros(caches.buffer.numel(), dtype=bool)  # bytes the request's blocks hold

    def fits(group: int, block_id: int) -> bool:
        return block_id in order and not held[caches.block_bytes(group, block_id)].any()

    def hold(group: int, block_id: int) -> int:
        order.remove(block_id)
        held[caches.block_bytes(group, block_id)] = True
        return block_id

    def take(group: int, n: int, run: bool = False) -> list[int]:
        taken: list[int] = []
        if run:
            start = next(b for b in order if fits(group, b) and fits(group, b + 1))
            taken = [hold(group, start), hold(group, start + 1)]
        while len(taken) < n:
            taken.append(hold(group, next(b for b in order if fits(group, b))))
        return taken

    ids: IdMap = {}
    for group in range(len(caches.config.kv_cache_groups)):
        if caches.is_state(group):
            ids[group] = [0] * (REQUEST_BLOCKS - 1) + take(group, 1)
        elif caches.is_sliding(group):
            keep = math.ceil(SLIDING_WINDOW / BLOCK_SIZE) + 1
            ids[group] = [0] * (REQUEST_BLOCKS - keep) + take(group, keep)
        else:
            ids[group] = take(group, REQUEST_BLOCKS, run=True)
    return ids


def moved_blocks(p: VllmCaches, p_ids: IdMap, d_ids: IdMap) -> list[tuple[str, int, int]]:
    """``(layer, P block, D block)`` for every layer and every non-null position of its group."""
    moved: list[tuple[str, int, int]] = []
    for group, spec in enumerate(p.config.kv_cache_groups):
        pairs = [(a, b) for a, b in zip(p_ids[group], d_ids[group], strict=True) if a and b]
        moved.extend((layer, a, b) for layer in spec.layer_names for a, b in pairs)
    return moved


@dataclass
class ByteRuns:
    """Element-sized runs ``src[i] -> dst[i]`` of ``length[i]`` bytes."""

    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def min_descriptors(self) -> int:
        """Maximal runs contiguous on both sides: sort by source, join what continues."""
        order = np.argsort(self.src, kind="stable")
        s, d, n = self.src[order], self.dst[order], self.length[order]
        assert np.all(s[1:] >= s[:-1] + n[:-1]), "a source byte is moved twice"
        joins = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
        return int(s.size - joins.sum())


def byte_runs(p: VllmCaches, d: VllmCaches, moved: list[tuple[str, int, int]]) -> ByteRuns:
    """Every element a move copies, P address to D address, read off vLLM's views."""
    src, dst, length = [], [], []
    for layer, a, b in moved:
        pb, db = p.block(layer, a), d.block(layer, b)
        assert pb.shape == db.shape and pb.dtype == db.dtype
        src.append(element_addresses(pb))
        dst.append(element_addresses(db))
        length.append(np.full(pb.numel(), pb.element_size(), dtype=np.int64))
    return ByteRuns(np.concatenate(src), np.concatenate(dst), np.concatenate(length))


def memory_order_runs(p: VllmCaches, d: VllmCaches, moved: list[tuple[str, int, int]]) -> ByteRuns:
    """A transpose on receive: each moved block's bytes in P's memory order land in D's block in
    D's memory order (its heads' runs one after the other), element by element."""
    src, dst, length = [], [], []
    for layer, a, b in moved:
        pb, db = p.block(layer, a), d.block(layer, b)
        src.append(np.sort(element_addresses(pb)))
        dst.append(np.sort(element_addresses(db)))
        length.append(np.full(pb.numel(), pb.element_size(), dtype=np.int64))
    return ByteRuns(np.concatenate(src), np.concatenate(dst), np.concatenate(length))


def apply_plan(plan: TransferPlan, p: VllmCaches, d: VllmCaches) -> None:
    """Copy every descriptor, after checking it stays inside both buffers (through the flat
    buffers, so the same code copies in host memory and in VRAM)."""
    p_lo, d_lo = p.buffer.data_ptr(), d.buffer.data_ptr()
    p_hi, d_hi = p_lo + p.buffer.numel(), d_lo + d.buffer.numel()
    src, dst, n = (a.astype(np.int64) for a in (plan.src, plan.dst, plan.lengths))
    assert np.all((src >= p_lo) & (src + n <= p_hi)), "a descriptor reads outside P's buffer"
    assert np.all((dst >= d_lo) & (dst + n <= d_hi)), "a descriptor writes outside D's buffer"
    p_buf, d_buf = p.buffer, d.buffer
    for s, t, length in zip((src - p_lo).tolist(), (dst - d_lo).tolist(), n.tolist(), strict=True):
        d_buf[t : t + length].copy_(p_buf[s : s + length])


def expected_destination(
    p: VllmCaches, d: VllmCaches, moved: list[tuple[str, int, int]]
) -> torch.Tensor:
    """D's buffer after the move, done through vLLM's views on a copy of D."""
    expected = twin(d)
    expected.buffer.copy_(d.buffer)
    for layer, a, b in moved:
        expected.block(layer, b).copy_(p.block(layer, a))
    return expected.buffer.clone()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` on the raw bits (random bytes hold NaNs, which never compare equal)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


def first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = np.flatnonzero(actual.cpu().numpy() != expected.cpu().numpy())
    return f"{diff.size} bytes differ, first at buffer offset {int(diff[0])}" if diff.size else ""


def transfer_and_check(p: VllmCaches, d: VllmCaches, *, minimal: bool) -> TransferPlan | None:
    """Plan, apply and verify one move; ``None`` when kvbridge refuses the pair of layouts."""
    p.fill(P_SEED)
    d.fill(D_SEED)
    p_ids, d_ids = request_block_ids(p, seed=1), request_block_ids(d, seed=2)
    if minimal:
        p_layout = Layout(build_layout_spec(p.config, p.views))
        d_layout = Layout(build_layout_spec(d.config, d.views))
        plan = plan_transfers(p_layout, d_layout, p_ids, d_ids)
    else:
        try:
            p_layout = Layout(build_layout_spec(p.config, p.views))
            d_layout = Layout(build_layout_spec(d.config, d.views))
            check_compatible(p_layout, d_layout)
            plan = plan_transfers(p_layout, d_layout, p_ids, d_ids)
        except LayoutError:  # LayoutMismatchError included: a refusal is a right answer
            return None
    groups = [g.layer_names for g in p.config.kv_cache_groups]
    assert groups == [g.layer_names for g in d.config.kv_cache_groups], (
        "kvbridge accepted caches whose vLLM groups differ"
    )
    moved = moved_blocks(p, p_ids, d_ids)
    transposes = received_transposes(p_layout, d_layout, p_ids, d_ids)
    runs = memory_order_runs(p, d, moved) if transposes else byte_runs(p, d, moved)
    expected = expected_destination(p, d, moved)
    p_before = p.buffer.clone()
    apply_plan(plan, p, d)
    layers = [g.layer_names for g in d.config.kv_cache_groups]
    transpose_received(d.views, layers, transposes)

    for layer, a, b in moved:
        assert same_bytes(d.block(layer, b), p.block(layer, a)), (
            f"layer {layer}: D block {b} is not P block {a}"
        )
    assert torch.equal(p.buffer, p_before), "the source buffer changed"
    assert torch.equal(d.buffer, expected), (
        f"bytes of D outside the moved blocks changed: {first_difference(d.buffer, expected)}"
    )
    assert plan.nbytes == runs.nbytes
    if minimal:
        assert plan.count == runs.min_descriptors(), (
            f"{plan.count} descriptors, the minimum is {runs.min_descriptors()} "
            f"(unmerged {plan.unmerged})"
        )
    return plan


@pytest.mark.parametrize(("layout", "kind", "ratio"), CASES)
def test_transfer_is_exact_and_minimal(layout: str, kind: str, ratio: int) -> None:
    p = _build(kind, layout, ratio)
    d = _build(kind, layout, ratio)
    if p is None or d is None:
        return
    if (layout, kind) in ALIASING:
        with pytest.raises(LayoutError, match="overlay the same buffer"):
            build_layout_spec(p.config, p.views)
        return
    transfer_and_check(p, d, minimal=True)


@pytest.mark.parametrize(("p_layout", "d_layout", "kind", "ratio"), MIXED_CASES)
def test_every_pair_of_layouts_moves_exactly_or_is_refused_with_its_reason(
    p_layout: str, d_layout: str, kind: str, ratio: int
) -> None:
    """P and D on different layouts (another attention backend or GPU generation): pairs whose
    blocks hold the same heads' tokens in another place move exactly, at the minimum descriptor
    count of the pair (each side's own strides); a token-major and a head-major side move P's
    bytes in P's order into D's blocks at the minimum for that placement, and D's permute makes
    every block read through vLLM's views equal P's. No pair is refused for its block format
    (other refusals: vLLM's own, aliasing block ids, groups that differ)."""
    p = _build(kind, p_layout, ratio)
    d = _build(kind, d_layout, ratio)
    if p is None or d is None or {(p_layout, kind), (d_layout, kind)} & ALIASING:
        return
    p_spec = Layout(build_layout_spec(p.config, p.views))
    d_spec = Layout(build_layout_spec(d.config, d.views))
    try:
        check_compatible(p_spec, d_spec)
    except LayoutError as err:
        assert "block format" not in str(err), err
        return
    plan = transfer_and_check(p, d, minimal=True)
    assert plan is not None
    transposed = kind != "mla" and (p_layout in TOKEN_MAJOR) != (d_layout in TOKEN_MAJOR)
    ids = request_block_ids(p, seed=1), request_block_ids(d, seed=2)
    assert bool(received_transposes(p_spec, d_spec, *ids)) == transposed


BUILDER_CASES = [
    pytest.param(
        layout,
        kind,
        id=f"{layout}-{kind}",
        marks=[
            pytest.mark.xfail(
                strict=True,
                reason="vLLM 0.32 under LHBNC: an attention block is H head slices a B-block "
                "stride apart while a Mamba block is one page, so one block id of one group "
                "overlays other block ids of the other group",
            )
        ]
        if (layout, kind) in ALIASING
        else [],
    )
    for layout in LAYOUTS
    for kind in KINDS
]


@pytest.mark.parametrize(("layout", "kind"), BUILDER_CASES)
def test_vllm_block_ids_own_disjoint_bytes(layout: str, kind: str) -> None:
    """The oracle's footing, and vLLM's invariant: a block id's bytes belong to it alone.

    Within a group distinct ids never overlap (``block_owners`` asserts it). Across groups,
    which overlay one buffer, the bytes block ``b`` holds in one group may only be held by the
    same id ``b`` in another group (a block is owned by one group at a time).
    """
    caches = _build(kind, layout, 1)
    if caches is None:
        return
    owners = [caches.block_owners(g) for g in range(len(caches.config.kv_cache_groups))]
    for g, mine in enumerate(owners):
        for h, theirs in enumerate(owners[:g]):
            clash = (mine >= 0) & (theirs >= 0) & (mine != theirs)
            assert not clash.any(), (
                f"{int(clash.sum())} bytes are held by block {int(mine[clash][0])} of group {g} "
                f"and by block {int(theirs[clash][0])} of group {h}"
            )


def test_fill_pattern_words_are_distinct() -> None:
    words = distinct_words(1 << 20, seed=P_SEED).view(np.uint64)
    assert np.unique(words).size == words.size


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the checks in VRAM")
def test_every_layout_in_vram_is_exact_and_minimal() -> None:
    # The same checks on caches vLLM allocates in VRAM (only the copy goes through the GPU).
    for layout in LAYOUTS:
        for kind in KINDS:
            for ratio in RATIOS:
                p = _build(kind, layout, ratio, device="cuda")
                d = _build(kind, layout, ratio, device="cuda")
                if p is None or d is None or (layout, kind) in ALIASING:
                    continue
                transfer_and_check(p, d, minimal=True)


def test_plan_command_names_the_transpose_on_receive(tmp_path, capsys) -> None:
    """``kvbridge plan`` for a token-major P and a per-head D: the plan, and which kernel blocks
    D permutes after it (text and JSON)."""
    from kvbridge.cli import main

    p, d = build_caches("attention", "LBNHC", 1), build_caches("attention", "LHBNC", 1)
    p_ids, d_ids = request_block_ids(p, seed=1), request_block_ids(d, seed=2)
    files = []
    for name, caches in (("prefill", p), ("decode", d)):
        path = tmp_path / f"{name}.json"
        path.write_bytes(Layout(build_layout_spec(caches.config, caches.views)).to_json())
        files.append(str(path))
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps({"prefill": p_ids, "decode": d_ids}))
    assert main(["plan", *files, str(blocks)]) == 0
    moved = sum(len([b for b in ids if b]) for ids in d_ids.values())
    assert f"decode transposes {moved} kernel blocks" in capsys.readouterr().out
    assert main(["plan", *files, str(blocks), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sum(doc["transposed_on_receive"].values()) == moved
