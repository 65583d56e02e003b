"""A vLLM worker's KV caches, built on the CPU by vLLM's own code, under any physical layout.

Nothing here re-derives a stride: layers are grouped by ``get_kv_cache_groups``, placed by
``get_kv_cache_config_from_groups`` (which reads ``cache_config.kv_cache_layout``) and viewed by
``allocate_kv_cache`` / ``create_kv_cache_views``, exactly as a model runner does before it calls
a connector's ``register_kv_caches``. Where vLLM refuses a combination (a layout that cannot
express the model, kernel blocks that cannot split a page), ``build_caches`` raises
``VllmRefused`` carrying vLLM's own message.

Model kinds (``KINDS``), all bf16, ``BLOCK_SIZE`` tokens per block:

* ``attention``: three full-attention layers, 4 KV heads of 16;
* ``sliding``: two full-attention and two sliding-window layers (same page), which the hybrid
  allocator puts in two groups overlaying one buffer;
* ``mla``: three MLA layers (one latent "head" of 72);
* ``gdn``: two full-attention and four GDN layers whose Mamba pages are padded to the attention
  page, as vLLM's platform hook (``_align_hybrid_block_size``) does for hybrid models;
* ``gdn_packed``: the same model with unpadded Mamba specs: on layer-outer layouts vLLM pads
  them itself (``unify_kv_cache_spec_page_size``); on block-outermost ones it packs the small
  pages side by side in each block (``_get_packed_kv_cache_groups``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge.adapters.vllm.versions import get_kv_cache_config_from_groups, get_kv_cache_groups

BLOCK_SIZE = 32
NUM_BLOCKS = 24
SLIDING_WINDOW = 64
DTYPE = torch.bfloat16
KINDS = ("attention", "sliding", "mla", "gdn", "gdn_packed")
LAYOUTS = tuple(layout.name for layout in KVCacheLayout)
GDN_SHAPES = ((3, 16), (2, 8, 8))
GDN_DTYPES = (torch.bfloat16, torch.float32)


class VllmRefused(Exception):
    """vLLM itself refuses to allocate this model under this layout and kernel block size."""


def _attention(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=16, dtype=DTYPE, **kw)


def _gdn(page_size_padded: int | None) -> MambaSpec:
    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=GDN_SHAPES,
        dtypes=GDN_DTYPES,
        page_size_padded=page_size_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )


def model_specs(kind: str) -> dict[str, KVCacheSpec]:
    """Layer name -> spec, in model order, as the model runner's ``get_kv_cache_spec`` gives."""
    if kind == "attention":
        return {f"attn{i}": _attention() for i in range(3)}
    if kind == "sliding":
        swa = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=4,
            head_size=16,
            dtype=DTYPE,
            sliding_window=SLIDING_WINDOW,
        )
        return {"attn0": _attention(), "swa0": swa, "attn1": _attention(), "swa1": swa}
    if kind == "mla":
        mla = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=72, dtype=DTYPE)
        return {f"mla{i}": mla for i in range(3)}
    if kind in ("gdn", "gdn_packed"):
        attn = _attention()
        padded = attn.page_size_bytes if kind == "gdn" else None
        assert padded is None or padded >= _gdn(None).page_size_bytes
        gdn = _gdn(padded)
        return {
            "gdn0": gdn,
            "gdn1": gdn,
            "attn0": attn,
            "gdn2": gdn,
            "gdn3": gdn,
            "attn1": attn,
        }
    raise ValueError(f"unknown model kind {kind!r}; known: {KINDS}")


def vllm_config(layout: str, num_blocks: int = NUM_BLOCKS) -> VllmConfig:
    """A model-less ``VllmConfig`` whose resolved layout is ``layout`` and pool ``num_blocks``."""
    config = VllmConfig()
    config.cache_config.kv_cache_layout = KVCacheLayout[layout].name
    config.cache_config.num_gpu_blocks_override = num_blocks  # may_override_num_blocks
    return config


def _layer_spec(group_spec: KVCacheSpec, layer: str) -> KVCacheSpec:
    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return group_spec.kv_cache_specs[layer]
    return group_spec


def _is_state(spec: KVCacheSpec) -> bool:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    return isinstance(spec, MambaSpec)


def _is_sliding(spec: KVCacheSpec) -> bool:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    return isinstance(spec, SlidingWindowSpec)


def make_kv_cache_config(
    kind: str,
    layout: str,
    num_blocks: int = NUM_BLOCKS,
    *,
    specs: dict[str, KVCacheSpec] | None = None,
    tp_size: int = 1,
) -> KVCacheConfig:
    """vLLM's grouping and placement of the model's layers (``VllmRefused`` if it refuses);
    ``specs``: one TP rank's layer specs instead of ``kind``'s (``tp_size`` ranks)."""
    config = vllm_config(layout, num_blocks)
    config.parallel_config.tensor_parallel_size = tp_size
    try:
        groups = get_kv_cache_groups(config, specs if specs is not None else model_specs(kind))
        # The override fixes the pool; the memory given is what that pool takes when every
        # layer's page is placed one after the other (the layer-outer bytes per block).
        page_bytes = sum(
            _layer_spec(g.kv_cache_spec, name).page_size_bytes
            for g in groups
            for name in g.layer_names
        )
        kv_config = get_kv_cache_config_from_groups(config, groups, page_bytes * num_blocks)
    except (ValueError, AssertionError, NotImplementedError) as err:
        raise VllmRefused(f"{type(err).__name__}: {err}") from err
    assert kv_config.num_blocks == num_blocks
    return kv_config


def kernel_block_sizes(kv_config: KVCacheConfig, ratio: int) -> list[int]:
    """Kernel block size per group: attention split ``ratio`` ways, Mamba whole (as vLLM)."""
    sizes = []
    for group in kv_config.kv_cache_groups:
        block = group.kv_cache_spec.block_size
        sizes.append(block if _is_state(group.kv_cache_spec) else block // ratio)
    return sizes


def backing_buffer(views: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The one int8 allocation every registered view shares, as a flat tensor."""
    storages = {int(v.untyped_storage().data_ptr()) for v in views.values()}
    assert len(storages) == 1, f"views span {len(storages)} allocations"
    storage = next(iter(views.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.int8, device=storage.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat


def distinct_words(nbytes: int, seed: int) -> npt.NDArray[np.uint8]:
    """``nbytes`` bytes whose aligned 8-byte words are all distinct (splitmix64, a bijection)."""
    words = np.arange(math.ceil(nbytes / 8), dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = words + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    out: npt.NDArray[np.uint8] = z.view(np.uint8)[:nbytes]
    return out


def fill_distinct(buffer: torch.Tensor, seed: int) -> None:
    """Overwrite a flat int8 buffer with ``distinct_words`` of ``seed``."""
    assert buffer.dtype == torch.int8 and buffer.dim() == 1 and buffer.is_contiguous()
    pattern = distinct_words(buffer.numel(), seed)
    buffer.copy_(torch.from_numpy(pattern.view(np.int8)))


@dataclass
class VllmCaches:
    """One worker's caches: what vLLM configured, allocated and registers with a connector."""

    kind: str
    layout: str
    ratio: int
    config: KVCacheConfig
    views: dict[str, torch.Tensor]
    kernel_sizes: list[int]
    device: str = "cpu"

    @property
    def buffer(self) -> torch.Tensor:
        return backing_buffer(self.views)

    def fill(self, seed: int) -> None:
        fill_distinct(self.buffer, seed)

    def group_of(self, layer: str) -> int:
        return next(i for i, g in enumerate(self.config.kv_cache_groups) if layer in g.layer_names)

    def group_ratio(self, group: int) -> int:
        """Kernel blocks per logical block of a group (1 for Mamba)."""
        return (
            self.config.kv_cache_groups[group].kv_cache_spec.block_size
            // (self.kernel_sizes[group])
        )

    def is_state(self, group: int) -> bool:
        return _is_state(self.config.kv_cache_groups[group].kv_cache_spec)

    def is_sliding(self, group: int) -> bool:
        return _is_sliding(self.config.kv_cache_groups[group].kv_cache_spec)

    def layer_spec(self, layer: str) -> KVCacheSpec:
        group = self.config.kv_cache_groups[self.group_of(layer)]
        return _layer_spec(group.kv_cache_spec, layer)

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        """vLLM's logical block ``block_id`` of a layer: its kernel blocks, as the view has them.

        Attention/MLA: ``view[b*ratio : (b+1)*ratio]`` of the ``[B*ratio, H, N, C]`` view.
        Mamba: ``view[b : b+1]`` of the int8 ``[B, 1, 1, state bytes]`` view (one state slot).
        """
        r = self.group_ratio(self.group_of(layer))
        return self.views[layer][block_id * r : (block_id + 1) * r]

    def block_bytes(self, group: int, block_id: int) -> npt.NDArray[np.int64]:
        """Buffer offsets of every byte that logical block ``block_id`` of a group holds."""
        base = self.buffer.data_ptr()
        parts = []
        for layer in self.config.kv_cache_groups[group].layer_names:
            block = self.block(layer, block_id)
            addr = element_addresses(block) - base
            parts.append((addr[:, None] + np.arange(block.element_size())).reshape(-1))
        return np.concatenate(parts)

    def block_owners(self, group: int) -> npt.NDArray[np.int64]:
        """For every byte of the buffer, the block id of ``group`` that holds it (-1: none)."""
        owners = np.full(self.buffer.numel(), -1, dtype=np.int64)
        for block_id in range(self.config.num_blocks):
            idx = self.block_bytes(group, block_id)
            assert np.all(owners[idx] == -1), f"group {group}: block {block_id} overlaps another"
            owners[idx] = block_id
        return owners


def allocate(
    kv_config: KVCacheConfig, layout: str, kernel_sizes: list[int], device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """``allocate_kv_cache`` on ``device`` (``VllmRefused`` if vLLM refuses the kernel sizes)."""
    try:
        return allocate_kv_cache(
            kv_config, torch.device(device), KVCacheLayout[layout], kernel_sizes
        )
    except (ValueError, AssertionError) as err:
        raise VllmRefused(f"{type(err).__name__}: {err}") from err


def build_caches(
    kind: str, layout: str, ratio: int = 1, num_blocks: int = NUM_BLOCKS, device: str = "cpu"
) -> VllmCaches:
    """A fresh allocation of the model's caches (zeroed, as vLLM leaves them)."""
    kv_config = make_kv_cache_config(kind, layout, num_blocks)
    kernel_sizes = kernel_block_sizes(kv_config, ratio)
    views = allocate(kv_config, layout, kernel_sizes, device)
    return VllmCaches(kind, layout, ratio, kv_config, views, kernel_sizes, device)


def twin(caches: VllmCaches) -> VllmCaches:
    """A second allocation with the same config (vLLM's views over a different buffer)."""
    views = allocate(caches.config, caches.layout, caches.kernel_sizes, caches.device)
    return VllmCaches(
        caches.kind,
        caches.layout,
        caches.ratio,
        caches.config,
        views,
        caches.kernel_sizes,
        caches.device,
    )


def element_addresses(t: torch.Tensor) -> npt.NDArray[np.int64]:
    """Absolute byte address of every element of ``t``, in ``t``'s logical (row-major) order."""
    esize = t.element_size()
    addr = np.full((), t.data_ptr(), dtype=np.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        addr = addr[..., None] + np.arange(size, dtype=np.int64) * (stride * esize)
    out: npt.NDArray[np.int64] = addr.reshape(-1)
    return out
