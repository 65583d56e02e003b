"""``kvbridge demo``: a real transfer between two processes, verified byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvbridge.core import plan_transfers
from kvbridge.core.layout import Layout
from kvbridge.demo import (
    AddressMap,
    DemoConfig,
    build_engine_cache,
    cache_bytes,
    pool_blocks,
    verify_decode_cache,
)
from kvbridge.workloads.layouts import PoolExhaustedError, request_block_ids
from kvbridge.workloads.shapes import SHAPES, bump_allocator, layout_spec


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_demo_moves_and_verifies_a_hybrid_request_through_mooncake(mode):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge.cli",
            "demo",
            "--transport",
            "mooncake",
            "--mode",
            mode,
            "--layers",
            "8",
            "--num-blocks",
            "8",
            "--prompt-tokens",
            "2048",
            "--json",
            "--timeout",
            "60",
            "--secret",
            "demo-secret",
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)
    assert run["transport"] == "mooncake" and run["mode"] == mode
    kinds = [g["kind"] for g in run["groups"]]
    # 8 layers: 2 full attention; 6 GDN in groups the size of the attention group, as in vLLM
    assert kinds == ["ATTENTION", "STATE", "STATE", "STATE"]
    assert run["remote_prefill_tokens"] == 2047
    assert run["descriptors_after"] < run["descriptors_before"]
    assert run["nbytes"] > 0 and run["verified_bytes"] > run["nbytes"]
    assert run["prefill_outcome"].startswith("freed")


def test_verification_catches_a_wrong_byte():
    config = DemoConfig(num_layers=8, num_blocks=6, prompt_tokens=1000)
    p_arena, p_layout, p_ids = build_engine_cache(config, config.seed)
    d_arena, d_layout, d_ids = build_engine_cache(config, config.seed + 1)
    original = [b.copy() for b in d_arena.buffers]
    plan = plan_transfers(p_layout, d_layout, p_ids, d_ids)
    # move the bytes in-process, as a transport would
    source = AddressMap(p_arena.bases, p_arena.buffers)
    target = AddressMap(d_arena.bases, d_arena.buffers)
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True):
        target.view(d, n)[:] = source.view(s, n)
    verified, _ = verify_decode_cache(config, d_arena, d_layout, original)
    assert verified == sum(b.size for b in d_arena.buffers)
    # one byte outside the plan changes: caught
    base = d_arena.bases[0]
    untouched = np.ones(d_arena.buffers[0].size, dtype=bool)
    for d, n in zip(plan.dst.tolist(), plan.lengths.tolist(), strict=True):
        if base <= d < base + untouched.size:
            untouched[d - base : d - base + n] = False
    i = int(np.flatnonzero(untouched)[0])
    d_arena.buffers[0][i] ^= 0xFF
    with pytest.raises(AssertionError, match="differs"):
        verify_decode_cache(config, d_arena, d_layout, original)
    d_arena.buffers[0][i] ^= 0xFF
    # one moved byte is wrong: caught
    target.view(int(plan.dst[0]), 1)[0] ^= 0x01
    with pytest.raises(AssertionError, match="differs"):
        verify_decode_cache(config, d_arena, d_layout, original)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_default_pool_holds_the_request_with_room_to_spare(shape):
    # num_blocks was 32 for every shape: too few for 8,192 tokens but for the hybrid's
    config = DemoConfig(shape=shape, prompt_tokens=8192)
    assert config.num_blocks == pool_blocks(shape, 8192)
    p_layout = Layout(layout_spec(SHAPES[shape], config.blocks, bump_allocator()))
    ids = request_block_ids(p_layout, 8192, np.random.default_rng(0))
    taken = {b for blocks in ids.values() for b in blocks} - {0}
    assert len(taken) < config.blocks - 1  # spare blocks beside the request and null block 0
    assert len(taken) >= 0.8 * config.blocks  # but not a pool many times the request
    with pytest.raises(PoolExhaustedError):
        smaller = Layout(layout_spec(SHAPES[shape], len(taken), bump_allocator()))
        request_block_ids(smaller, 8192, np.random.default_rng(0))


def test_a_small_request_builds_a_small_cache_on_every_shape():
    for shape in SHAPES:
        config = DemoConfig(shape=shape, num_layers=2, prompt_tokens=300)
        arena, _, ids = build_engine_cache(config, config.seed)
        assert sum(b.size for b in arena.buffers) == cache_bytes(shape, config.blocks, 2)
        assert cache_bytes(shape, config.blocks, 2) < 64 * 2**20
        assert all(ids.values())


def test_verification_rebuilds_decodes_bytes_from_its_seed_without_a_copy():
    config = DemoConfig(shape="gpt-oss-sliding", num_layers=4, prompt_tokens=700)
    p_arena, p_layout, p_ids = build_engine_cache(config, config.seed)
    d_arena, d_layout, d_ids = build_engine_cache(config, config.seed + 1)
    plan = plan_transfers(p_layout, d_layout, p_ids, d_ids)
    source = AddressMap(p_arena.bases, p_arena.buffers)
    target = AddressMap(d_arena.bases, d_arena.buffers)
    with pytest.raises(AssertionError, match="differs"):  # nothing moved yet
        verify_decode_cache(config, d_arena, d_layout)
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True):
        target.view(d, n)[:] = source.view(s, n)
    verified, _ = verify_decode_cache(config, d_arena, d_layout)
    assert verified == sum(b.size for b in d_arena.buffers)
    last = d_arena.buffers[-1]
    last[-1] ^= 0xFF  # every byte of the cache is checked, moved or not
    with pytest.raises(AssertionError, match="differs"):
        verify_decode_cache(config, d_arena, d_layout)
