"""Layouts: what a worker registered, expanded into transfer regions.

A ``LayoutSpec`` is the compact, serialisable description an adapter produces (groups and the
cache tensors of each layer); it is what two sides exchange and what ``kvbridge plan`` reads from
JSON. ``Layout`` is derived from it: the regions that move and the memory ranges to register.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge.core.errors import LayoutError
from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.memory import MemoryKind, MemoryRange


class KVLayout(str, enum.Enum):
    """Where V sits relative to K in an attention tensor."""

    BLOCKS_FIRST = "blocks_first"  # each kernel block holds K then V: [blocks, 2, tokens, ...]
    K_FIRST = "k_first"  # all K blocks, then all V blocks: [2, blocks, tokens, ...]
    #: K and V are not told apart: each block's bytes move whole, one region per tensor.
    #: Both sides must then agree on what the bytes mean (``LayoutSpec.block_format``).
    WHOLE = "whole"


class Part(str, enum.Enum):
    """Which bytes of a block a region moves."""

    K = "K"
    V = "V"
    WHOLE = "WHOLE"


class Shard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which slice of the model's cache a tensor holds under tensor parallelism (one axis).

    Units ``[start, start + count)`` of the global axis ``axis`` (``"kv_heads"``,
    ``"conv_q"``, ``"ssm_heads"``, ``"latent"`` ...) lie in every block (state slot) of the
    tensor, and in every part of it (K and V alike), at byte ``offset + i * unit_stride`` of
    the part's block for unit ``start + i``, each ``unit_bytes`` long; with ``rows`` > 1 that
    pattern repeats ``row_stride`` bytes apart (a token-major conv state ``[kernel-1, channels]``
    holds a slice of each sub-projection in every row). Offsets and sizes are counted per
    logical block like ``CacheTensor.block_bytes``: in each kernel block they are divided by the
    kernel ratio. ``unit_stride`` 0 means ``unit_bytes`` (units packed).

    ``replicas`` ranks hold the same units (KV heads fewer than TP ranks, MLA's latent on every
    rank); ``replica`` is which of them this rank is. A destination replica ``j`` of ``d``
    reads from the source replica ``j * source replicas // d`` (``kvbridge.core.tp``), so every
    unit is read once and replicated readers spread over the sources. ``token_major``: each
    unit's bytes in a kernel block list its tokens in order, each token's bytes one run of the
    same size (a head of a head-major ``[H, N, C]`` block with ``[K|V]`` cells): slices of such
    units may move between different kernel block sizes, unit by unit.
    """

    axis: str
    start: int
    count: int
    unit_bytes: int
    offset: int = 0
    unit_stride: int = 0
    rows: int = 1
    row_stride: int = 0
    replicas: int = 1
    replica: int = 0
    token_major: bool = False

    @property
    def stride(self) -> int:
        """Bytes from one unit to the next."""
        return self.unit_stride or self.unit_bytes

    @property
    def end(self) -> int:
        return self.start + self.count


class CacheTensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cache tensor a worker registered for one layer.

    ``addr`` is the address of logical block 0 (of K, for attention); ``block_stride`` the bytes
    from one logical block (or state slot) to the next; ``block_bytes`` the bytes of one logical
    block that belong to one part (K, or V, or the whole block for MLA and STATE).
    Attention tensors also say where V is: ``v_addr`` (K-first) or ``v_offset`` (blocks-first;
    default right after K), counted per logical block like ``block_bytes``: V starts
    ``v_offset / ratio`` bytes into each kernel block. ``tensor`` tells apart several tensors of
    one layer (a GDN layer's ``conv`` and ``ssm`` state). ``alloc_addr``/``alloc_size`` name the
    backing allocation to register; by default the tensor's own extent. ``token_major`` says
    that each part of a kernel block lists its tokens in order, each token's bytes one run of
    the same size: only then may a block be split into token units, which planning between
    different kernel block sizes needs. ``shards`` says which slice of the model's cache the
    tensor holds under tensor parallelism (``Shard``, one per axis); unset or ``None``: the
    whole layer's cache, or nothing said, so it moves only between peers of equal TP size.
    """

    layer_name: str
    group_index: int
    addr: int
    block_stride: int
    block_bytes: int
    kv_layout: KVLayout = KVLayout.BLOCKS_FIRST
    v_addr: int | None = None
    v_offset: int | None = None
    tensor: str = ""
    alloc_addr: int | None = None
    alloc_size: int | None = None
    token_major: bool = True
    #: Unset (the default) is left out of the JSON form, which keeps layouts that say nothing
    #: about TP byte for byte what they were; ``None`` means the same.
    shards: list[Shard] | msgspec.UnsetType | None = msgspec.UNSET


class LayoutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a worker registered: the wire and JSON form of a layout.

    ``block_format`` says what the bytes of a region's block mean where the tensors alone do
    not (an engine's physical order within a block and how K and V share it, e.g.
    ``"[H,N,C] head_kv"``); two sides whose formats differ never exchange bytes. ``engine_layout``
    is the engine's own name for its physical layout (vLLM's ``KVCacheLayout``), for messages:
    two engine layouts may differ and still agree on every block's format.

    ``pp_rank`` of ``pp_size``: the pipeline stage whose layers these are (``tensors`` hold
    that stage's layers only; every stage shares the engine's block table). ``vram_device``:
    the GPU whose memory holds every tensor (-1: host memory), which is how the transport must
    register it.
    """

    groups: list[CacheGroup]
    tensors: list[CacheTensor]
    dtype: str = "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1
    block_format: str = ""
    engine_layout: str = ""
    pp_rank: int = 0
    pp_size: int = 1
    vram_device: int = -1

    @property
    def flat_rank(self) -> int:
        """This worker's index among its engine's ``pp_size * tp_size`` workers (stage-major)."""
        return self.pp_rank * self.tp_size + self.tp_rank


RegionKey = tuple[str, str, Part]


@dataclass(frozen=True)
class Region:
    """A strided array of blocks in registered memory.

    Kernel block (or state slot) ``k`` of this region occupies
    ``[base_addr + k*stride + offset, ... + length)``.
    """

    group_index: int
    layer_name: str
    tensor: str
    part: Part
    base_addr: int
    stride: int
    offset: int
    length: int
    token_major: bool = True

    @property
    def key(self) -> RegionKey:
        """What pairs a region with its counterpart on the other side."""
        return (self.layer_name, self.tensor, self.part)

    def extent(self, num_kernel_blocks: int) -> tuple[int, int]:
        """``[start, end)`` of the bytes this region may touch."""
        start = self.base_addr + self.offset
        return start, start + (num_kernel_blocks - 1) * self.stride + self.length


@dataclass(frozen=True)
class GroupRegions:
    """The regions of one group as parallel arrays, ready for vectorised planning."""

    group: CacheGroup
    regions: tuple[Region, ...]

    @cached_property
    def keys(self) -> list[RegionKey]:
        return [r.key for r in self.regions]

    @cached_property
    def memo(self) -> dict[Any, Any]:
        """What planning derives from this group and a peer's once, for every request (the
        planner's per-peer templates, ``kvbridge.core.memo.PairMemo``; regions never change
        once built)."""
        return {}

    def arrays(self) -> dict[str, npt.NDArray[np.int64]]:
        """``base`` (base+offset), ``stride`` and ``length`` per region (read-only, built once:
        every request's plan reads them)."""
        return self._arrays

    @cached_property
    def _arrays(self) -> dict[str, npt.NDArray[np.int64]]:
        out = {
            "base": np.array([r.base_addr + r.offset for r in self.regions], dtype=np.int64),
            "stride": np.array([r.stride for r in self.regions], dtype=np.int64),
            "length": np.array([r.length for r in self.regions], dtype=np.int64),
        }
        for values in out.values():
            values.flags.writeable = False
        return out


def expand_tensor(tensor: CacheTensor, group: CacheGroup) -> list[Region]:
    """The regions one tensor contributes: K and V for attention, one WHOLE otherwise."""
    ratio = group.ratio
    where = f"tensor {tensor.layer_name!r}{'/' + tensor.tensor if tensor.tensor else ''}"
    if tensor.block_stride <= 0 or tensor.block_bytes <= 0:
        raise LayoutError(f"{where}: block_stride and block_bytes must be positive")
    if tensor.block_stride % ratio or tensor.block_bytes % ratio:
        raise LayoutError(
            f"{where}: block_stride {tensor.block_stride} and block_bytes {tensor.block_bytes} "
            f"must be divisible by the kernel ratio {ratio}"
        )
    stride, length = tensor.block_stride // ratio, tensor.block_bytes // ratio

    def region(part: Part, base: int, offset: int = 0) -> Region:
        return Region(
            group.index,
            tensor.layer_name,
            tensor.tensor,
            part,
            base,
            stride,
            offset,
            length,
            tensor.token_major,
        )

    if group.kind in (GroupKind.MLA, GroupKind.STATE) or tensor.kv_layout is KVLayout.WHOLE:
        if length > stride:
            raise LayoutError(f"{where}: block_bytes {tensor.block_bytes} exceed the stride")
        return [region(Part.WHOLE, tensor.addr)]
    if tensor.kv_layout is KVLayout.K_FIRST:
        if tensor.v_addr is None:
            raise LayoutError(f"{where}: a k_first attention tensor needs v_addr")
        if length > stride:
            raise LayoutError(f"{where}: block_bytes {tensor.block_bytes} exceed the stride")
        return [region(Part.K, tensor.addr), region(Part.V, tensor.v_addr)]
    v_offset = length if tensor.v_offset is None else tensor.v_offset // ratio
    if tensor.v_offset is not None and tensor.v_offset % ratio:
        raise LayoutError(f"{where}: v_offset must be divisible by the kernel ratio {ratio}")
    if v_offset < length or v_offset + length > stride:
        raise LayoutError(
            f"{where}: K ({length} bytes) and V (at offset {v_offset}) do not fit in a "
            f"kernel block of {stride} bytes"
        )
    return [region(Part.K, tensor.addr), region(Part.V, tensor.addr, v_offset)]


def _merge_ranges(ranges: Sequence[tuple[int, int]], vram_device: int = -1) -> list[MemoryRange]:
    """De-duplicate backing allocations; overlapping ones become one (touching ones stay apart).
    ``vram_device`` >= 0: they lie in that GPU's memory."""
    merged: list[list[int]] = []
    for start, end in sorted(set(ranges)):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    if vram_device >= 0:
        return [MemoryRange(s, e - s, MemoryKind.VRAM, vram_device) for s, e in merged]
    return [MemoryRange(s, e - s) for s, e in merged]


class Layout:
    """A validated layout: groups, regions per group and memory ranges to register."""

    def __init__(self, spec: LayoutSpec) -> None:
        self.spec = spec
        problems: list[str] = []
        self.groups: dict[int, CacheGroup] = {}
        for group in spec.groups:
            if group.index in self.groups:
                problems.append(f"group index {group.index} appears twice")
            self.groups[group.index] = group
            problems.extend(group.validate())
        if not spec.groups:
            problems.append("a layout needs at least one group")
        if not 0 <= spec.tp_rank < spec.tp_size:
            problems.append(f"tp_rank {spec.tp_rank} is outside tp_size {spec.tp_size}")
        if not 0 <= spec.pp_rank < spec.pp_size:
            problems.append(f"pp_rank {spec.pp_rank} is outside pp_size {spec.pp_size}")
        if problems:
            raise LayoutError("invalid layout: " + "; ".join(problems))

        by_group: dict[int, list[Region]] = {g: [] for g in self.groups}
        allocations: list[tuple[int, int]] = []
        seen: set[RegionKey] = set()
        for tensor in spec.tensors:
            found = self.groups.get(tensor.group_index)
            if found is None:
                raise LayoutError(
                    f"tensor {tensor.layer_name!r} names group {tensor.group_index}, which the "
                    f"layout does not define (groups: {sorted(self.groups)})"
                )
            group = found
            regions = expand_tensor(tensor, group)
            for region in regions:
                if region.key in seen:
                    raise LayoutError(f"region {region.key} is defined twice")
                seen.add(region.key)
            alloc = self._allocation(tensor, group, regions)
            allocations.append(alloc)
            by_group[group.index].extend(regions)
        for index, regions in by_group.items():
            if len({r.part is Part.WHOLE for r in regions}) > 1:
                raise LayoutError(
                    f"group {index} mixes tensors moved whole with tensors split into K and V; "
                    "describe every tensor of a group the same way"
                )
        self.group_regions: dict[int, GroupRegions] = {
            g: GroupRegions(self.groups[g], tuple(rs)) for g, rs in sorted(by_group.items())
        }
        self.registration: list[MemoryRange] = _merge_ranges(allocations, spec.vram_device)

    @staticmethod
    def _allocation(
        tensor: CacheTensor, group: CacheGroup, regions: list[Region]
    ) -> tuple[int, int]:
        kernel_blocks = group.num_blocks * group.ratio
        extents = [r.extent(kernel_blocks) for r in regions]
        lo, hi = min(s for s, _ in extents), max(e for _, e in extents)
        if tensor.alloc_addr is None and tensor.alloc_size is None:
            return lo, hi
        if tensor.alloc_addr is None or tensor.alloc_size is None:
            raise LayoutError(
                f"tensor {tensor.layer_name!r}: give both alloc_addr and alloc_size, or neither"
            )
        start, end = tensor.alloc_addr, tensor.alloc_addr + tensor.alloc_size
        if lo < start or hi > end:
            raise LayoutError(
                f"tensor {tensor.layer_name!r}: its {group.num_blocks} blocks span "
                f"[{lo:#x}, {hi:#x}), outside its allocation [{start:#x}, {end:#x})"
            )
        return start, end

    @property
    def regions(self) -> list[Region]:
        """Every region, group by group."""
        return [r for gr in self.group_regions.values() for r in gr.regions]

    @property
    def has_state(self) -> bool:
        """Whether any group holds recurrent state (which forces the N-1 boundary)."""
        return any(g.kind is GroupKind.STATE for g in self.groups.values())

    @cached_property
    def memo(self) -> dict[Any, Any]:
        """What is derived from this layout and a peer's once, for every request
        (``kvbridge.core.memo.PairMemo``: compatibility, TP restriction)."""
        return {}

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.spec)

    @classmethod
    def from_json(cls, data: bytes | str) -> Layout:
        """Decode and validate a JSON layout spec; errors say which field is wrong."""
        try:
            spec = msgspec.json.decode(data, type=LayoutSpec)
        except msgspec.ValidationError as err:
            raise LayoutError(f"invalid layout: {err}") from None
        except msgspec.DecodeError as err:
            raise LayoutError(f"layout is not valid JSON: {err}") from None
        return cls(spec)
