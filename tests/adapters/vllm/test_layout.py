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
from kvbridge.core.compat import check_compatible  # noqa: E402
from kvbridge.core.errors import LayoutMismatchError  # noqa: E402


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


def test_attention_layer_block_is_one_whole_region_on_the_cpu_layout() -> None:
    # LBHNC (the CPU backend's only layout): a layer's kernel block [H, N, C] is one dense run,
    # moved whole, K and V together; head-major, so it does not split into tokens.
    config, kernels = hybrid_config(kernel=32)
    caches = allocate(config, kernels)
    spec = build_layout_spec(config, caches)
    assert spec.block_format.startswith("ATTENTION [H,N,C] head_kv")
    layout = Layout(spec)
    regions = {r.layer_name: r for r in layout.group_regions[0].regions}
    kv = caches["a1"]
    (region,) = [r for r in layout.group_regions[0].regions if r.layer_name == "a1"]
    assert region.part is Part.WHOLE and not region.token_major
    assert set(regions) == {"a0", "a1"}
    for kb in (0, 5, kv.shape[0] - 1):
        assert region.base_addr + kb * region.stride + region.offset == kv[kb].data_ptr()
        assert region.length == kv[kb].numel() * kv.element_size()


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


def test_head_major_blocks_refuse_different_kernel_sizes() -> None:
    # Kernel blocks of 32 and 64 tokens hold a head's tokens in different places: refused
    # with both sizes named, never split into wrong token units.
    p_config, p_kernels = hybrid_config(kernel=32)
    d_config, d_kernels = hybrid_config(kernel=64)
    p = Layout(build_layout_spec(p_config, allocate(p_config, p_kernels)))
    d = Layout(build_layout_spec(d_config, allocate(d_config, d_kernels)))
    with pytest.raises(LayoutMismatchError, match="kernel block size: P=32 D=64"):
        check_compatible(p, d)


def test_mla_pairs_different_kernel_sizes() -> None:
    # One latent head: a block lists its tokens in order, so kernel sizes may differ.
    config, kernels = single_group_config(mla_spec())
    p = Layout(build_layout_spec(config, allocate(config, kernels)))
    d = Layout(build_layout_spec(config, allocate(config, [BLOCK // 2])))
    assert (p.groups[0].kernel_size, d.groups[0].kernel_size) == (BLOCK, BLOCK // 2)
    check_compatible(p, d)


def test_block_formats_of_different_backends_do_not_pair() -> None:
    config, kernels = single_group_config(attn_spec())
    cpu = Layout(build_layout_spec(config, allocate(config, kernels)))
    other = Layout(build_layout_spec(config, allocate(config, kernels), split=SPLIT_OPAQUE))
    with pytest.raises(LayoutMismatchError, match="block format"):
        check_compatible(cpu, other)


def test_a_pipeline_stage_keeps_its_layers_and_needs_every_group() -> None:
    # vLLM gives a stage's worker its own layers' caches alone: the layout is that stage's,
    # and a stage holding no layer of a group is refused in one line (every stage shares the
    # engine's block ids of every group).
    from kvbridge.core.errors import LayoutError

    config, kernels = hybrid_config(kernel=32)
    caches = allocate(config, kernels)
    attention, state = (g.layer_names for g in config.kv_cache_groups)
    stage = {name: caches[name] for name in (attention[1], state[-1])}
    spec = build_layout_spec(config, stage, pp_rank=1, pp_size=2)
    assert (spec.pp_rank, spec.pp_size, spec.flat_rank) == (1, 2, 1)
    assert {t.layer_name for t in spec.tensors} == {attention[1], state[-1]}
    no_state = {name: caches[name] for name in attention}
    with pytest.raises(
        LayoutError, match=r"^pipeline stage 1 of 2 holds no layer of KV cache group 1 \(STATE\)"
    ):
        build_layout_spec(config, no_state, pp_rank=1, pp_size=2)
    # one engine (no stages) registers what it has, as before
    assert build_layout_spec(config, no_state).pp_size == 1


def test_the_caches_device_decides_how_they_are_registered() -> None:
    # host views register as host memory; views on two devices are refused (a CUDA view's index
    # is read the same way: benchmarks/gpu checks it on a GPU)
    from kvbridge.adapters.vllm.layout import vram_device_of
    from kvbridge.core.errors import LayoutError

    config, kernels = hybrid_config(kernel=32)
    caches = allocate(config, kernels)
    assert vram_device_of(caches.values()) == -1
    assert build_layout_spec(config, caches).vram_device == -1
    with pytest.raises(LayoutError, match="several devices"):
        vram_device_of([torch.zeros(1), torch.zeros(1, device="meta")])
