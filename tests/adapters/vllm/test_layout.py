"""vLLM KVCacheConfig + registered views → core layout, checked against vLLM's own views."""

from __future__ import annotations

import pytest

from tests.adapters.vllm.conftest import (
    BLOCK,
    NUM_BLOCKS,
    allocate,
    attn_spec,
    hybrid_config,
    mla_spec,
    single_group_config,
    sliding_spec,
)

torch = pytest.importorskip("torch")

from kvbridge.adapters.vllm.layout import SPLIT_OPAQUE, build_layout_spec  # noqa: E402
from kvbridge.core import GroupKind, Layout, Part  # noqa: E402


def test_hybrid_groups_kernels_and_shared_storage() -> None:
    config, kernels = hybrid_config(kernel=32)
    caches = allocate(config, kernels)
    layout = Layout(build_layout_spec(config, caches))
    attn, state = layout.groups[0], layout.groups[1]
    assert (attn.kind, attn.kernel_size, attn.ratio) == (GroupKind.ATTENTION, 32, 2)
    assert (state.kind, state.ratio) == (GroupKind.STATE, 1)  # no kernel expansion for state
    storage = caches["a0"].untyped_storage()
    # Attention and GDN layers overlay one buffer: registered once, whole.
    assert [(r.addr, r.size) for r in layout.registration] == [
        (storage.data_ptr(), storage.nbytes())
    ]
    page = attn_spec().page_size_bytes
    for region in layout.group_regions[1].regions:
        assert region.stride == page  # one state slot per logical block, not per kernel block


def test_attention_halves_are_the_cpu_backends_key_and_value() -> None:
    config, kernels = hybrid_config(kernel=32)
    caches = allocate(config, kernels)
    layout = Layout(build_layout_spec(config, caches))
    regions = {(r.layer_name, r.tensor, r.part): r for r in layout.group_regions[0].regions}
    kv = caches["a1"]
    blocks, heads, tokens, _ = kv.shape
    # vLLM's CPU attention: view [B, H, 2N, D] and split dim 2 into key and value caches.
    key, value = kv.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)
    for h in range(heads):
        for part, cache in ((Part.K, key), (Part.V, value)):
            region = regions[("a1", f"h{h}", part)]
            for kb in (0, 5, blocks - 1):
                addr = region.base_addr + kb * region.stride + region.offset
                assert addr == cache[kb, h].data_ptr()
                assert region.length == cache[kb, h].numel() * cache.element_size()


def test_state_tensors_match_the_views_mamba_layers_bind() -> None:
    config, kernels = hybrid_config()
    caches = allocate(config, kernels)
    layout = Layout(build_layout_spec(config, caches))
    regions = {(r.layer_name, r.tensor): r for r in layout.group_regions[1].regions}
    spec = config.kv_cache_groups[1].kv_cache_spec
    pages = caches["m1"].squeeze(dim=(1, 2))  # what MambaBase.bind_kv_cache slices
    offset = 0
    for name, shape, dtype in zip(("conv", "ssm"), spec.shapes, spec.dtypes, strict=True):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        region = regions[("m1", name)]
        assert region.part is Part.WHOLE and region.length == nbytes
        for slot in (1, NUM_BLOCKS - 1):
            assert region.base_addr + slot * region.stride == pages[slot, offset:].data_ptr()
        offset += nbytes


def test_mla_is_one_whole_region_per_layer() -> None:
    config, kernels = single_group_config(mla_spec())
    caches = allocate(config, kernels)
    layout = Layout(build_layout_spec(config, caches))
    group = layout.groups[0]
    assert group.kind is GroupKind.MLA
    (region, _) = layout.group_regions[0].regions
    assert region.part is Part.WHOLE
    assert region.length == BLOCK * 576 * 2 and region.stride == region.length


def test_sliding_window_group() -> None:
    config, kernels = single_group_config(sliding_spec(window=128))
    layout = Layout(build_layout_spec(config, allocate(config, kernels)))
    assert layout.groups[0].kind is GroupKind.SLIDING_WINDOW
    assert layout.groups[0].sliding_window == 128


def test_opaque_split_names_the_kernel_size() -> None:
    # Where the backend's K/V split is unknown, different kernel sizes must not pair up.
    config, kernels = single_group_config(attn_spec())
    spec = build_layout_spec(config, allocate(config, kernels), split=SPLIT_OPAQUE)
    assert {t.tensor for t in spec.tensors} == {f"h0@k{BLOCK}", f"h1@k{BLOCK}"}
