"""The example layouts and requests shipped under ``examples/`` (regenerated, never hand-edited)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np

from kvbridge.core.boundary import blocks_for_tokens, remote_prefill_token_count
from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import Layout
from kvbridge.workloads.shapes import SHAPES, ModelShape, bump_allocator, layout_spec

PROMPT_TOKENS = 4096
PREFILL_BLOCKS = 4096
DECODE_BLOCKS = 2048


def fragmented_pool(pool_size: int, rng: np.random.Generator, max_run: int = 8) -> list[int]:
    """Block ids ``1 .. pool_size-1`` as runs of random length in random order.

    That is how a busy allocator's free list looks; id 0 is vLLM's null block.
    """
    ids = np.arange(1, pool_size)
    cuts = np.cumsum(rng.integers(1, max_run + 1, size=pool_size))
    runs = np.split(ids, cuts[cuts < ids.size])
    order = rng.permutation(len(runs))
    return [int(b) for i in order for b in runs[i]]


class PoolExhaustedError(ValueError):
    """A request needs more blocks than the pool holds."""


def draw_request_ids(layout: Layout, prompt_tokens: int, pool: list[int]) -> dict[int, list[int]]:
    """Block ids one engine holds for a request's remote-prefilled tokens, taken from ``pool``
    (free ids in the order an allocator hands them out).

    Groups draw from one pool (as vLLM's hybrid allocator does), so their ids never collide;
    STATE groups hold null placeholders for every block but the last.
    """
    tokens = remote_prefill_token_count(prompt_tokens, layout.has_state)
    ids: dict[int, list[int]] = {}
    taken = 0
    for index, group in sorted(layout.groups.items()):
        count = blocks_for_tokens(tokens, group.block_size)
        if group.kind is GroupKind.STATE:
            ids[index] = [group.null_block_id] * (count - 1) + pool[taken : taken + 1]
            taken += 1
        else:
            ids[index] = pool[taken : taken + count]
            taken += count
    if taken > len(pool):
        raise PoolExhaustedError(f"the pool of {len(pool)} free blocks cannot hold {taken} blocks")
    return ids


def request_block_ids(
    layout: Layout, prompt_tokens: int, rng: np.random.Generator
) -> dict[int, list[int]]:
    """``draw_request_ids`` from a fragmented pool (a busy allocator's free list)."""
    pool = fragmented_pool(min(g.num_blocks for g in layout.groups.values()), rng)
    return draw_request_ids(layout, prompt_tokens, pool)


def example_files(shape: ModelShape, seed: int = 0) -> dict[str, object]:
    """The three JSON documents of one example: both layouts and the request's block ids."""
    prefill = layout_spec(shape, PREFILL_BLOCKS, bump_allocator(0x7F00_0000_0000))
    decode = layout_spec(shape, DECODE_BLOCKS, bump_allocator(0x7E00_0000_0000))
    rng = np.random.default_rng(seed)
    blocks = {
        "prompt_tokens": PROMPT_TOKENS,
        "prefill": request_block_ids(Layout(prefill), PROMPT_TOKENS, rng),
        "decode": request_block_ids(Layout(decode), PROMPT_TOKENS, rng),
    }
    return {
        "prefill.json": msgspec.to_builtins(prefill),
        "decode.json": msgspec.to_builtins(decode),
        "blocks.json": blocks,
    }


def write_examples(root: Path) -> list[Path]:
    """Write every example under ``root/<shape name>/``; return the files written."""
    written = []
    for name, shape in SHAPES.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for filename, doc in example_files(shape).items():
            path = folder / filename
            path.write_text(json.dumps(doc, indent=1) + "\n")
            written.append(path)
    return written
