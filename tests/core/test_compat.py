"""The layout compatibility check names every differing field."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.core import (
    CacheGroup,
    GroupKind,
    Layout,
    LayoutMismatchError,
    LayoutSpec,
    check_compatible,
    layout_differences,
)

from .layouts import Arena, hybrid_layout


def test_same_model_with_different_addresses_order_and_kernel_sizes_is_compatible():
    p = hybrid_layout(Arena(), num_blocks=16, kernel_block_size=4)
    d = hybrid_layout(Arena(next=1 << 20), num_blocks=9, kernel_block_size=8, reverse_tensors=True)
    check_compatible(p, d)
    assert layout_differences(p, d) == []


def test_every_differing_field_is_named():
    p = hybrid_layout(Arena())
    spec = p.spec
    groups = [
        msgspec.structs.replace(spec.groups[0], block_size=32),
        msgspec.structs.replace(spec.groups[1], kind=GroupKind.MLA),
    ]
    tensors = [t for t in spec.tensors if t.layer_name != "layers.1.attn"]
    tensors = [
        msgspec.structs.replace(t, layer_name="renamed.attn")
        if t.layer_name == "layers.0.attn"
        else t
        for t in tensors
    ]
    d = Layout(LayoutSpec(groups, tensors, dtype="float16", tp_size=2))
    with pytest.raises(LayoutMismatchError) as err:
        check_compatible(p, d)
    diffs = err.value.differences
    text = str(err.value)
    assert "\n" not in text
    for needle in (
        "dtype: P='bfloat16' D='float16'",
        "tp_size: P=1 D=2",
        "group 1 kind: P='STATE' D='MLA'",
        "only on P: [layers.0.attn:K, layers.0.attn:V, layers.1.attn:K, layers.1.attn:V]",
        "only on D: [renamed.attn:K, renamed.attn:V]",
    ):
        assert any(needle in diff for diff in diffs), (needle, diffs)


def test_a_different_block_format_is_said_once_and_lists_are_short():
    p = hybrid_layout(Arena())
    d = Layout(msgspec.structs.replace(p.spec, block_format="[N,H,C]", engine_layout="LBNHC"))
    with pytest.raises(LayoutMismatchError) as err:
        check_compatible(p, d)
    (only,) = err.value.differences  # regions are not listed once the format differs
    assert "block format: P='' D='[N,H,C]' (engine layout LBNHC)" in only
    many = [
        msgspec.structs.replace(t, layer_name=f"x{i}.{t.layer_name}")
        for i in range(3)
        for t in p.spec.tensors
    ]
    wide = Layout(msgspec.structs.replace(p.spec, tensors=many))
    with pytest.raises(LayoutMismatchError) as wide_err:
        check_compatible(p, wide)
    text = str(wide_err.value)
    assert " more]" in text and len(text) < 1000


def test_bytes_per_unit_and_group_set_differences():
    arena = Arena()
    p = hybrid_layout(arena)
    groups = [*p.spec.groups, CacheGroup(2, GroupKind.ATTENTION, 16, 4)]
    tensors = [
        msgspec.structs.replace(t, block_bytes=t.block_bytes // 2) if t.tensor == "ssm" else t
        for t in p.spec.tensors
    ]
    d = Layout(LayoutSpec(groups, tensors))
    diffs = layout_differences(p, d)
    assert "group indices: P=[0, 1] D=[0, 1, 2]" in diffs
    assert "group 1 region layers.0.gdn/ssm:WHOLE bytes per state slot: P=200 D=100" in diffs


def test_sliding_window_size_must_match():
    def layout(window: int) -> Layout:
        group = CacheGroup(0, GroupKind.SLIDING_WINDOW, 16, 4, sliding_window=window)
        return Layout(LayoutSpec([group], []))

    assert layout_differences(layout(64), layout(128)) == ["group 0 sliding_window: P=64 D=128"]
