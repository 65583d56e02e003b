"""What the benchmarks move: real models' cache shapes at the block sizes engines use, and the
block ids a request holds (contiguous, fully fragmented, or in runs of random length)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from kvbridge.core.boundary import blocks_for_tokens, remote_prefill_token_count
from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import Layout
from kvbridge.workloads.layouts import draw_request_ids, fragmented_pool
from kvbridge.workloads.shapes import (
    DEEPSEEK_MLA,
    GPT_OSS_SLIDING,
    LLAMA3_DENSE,
    QWEN35_HYBRID,
    ModelShape,
    bump_allocator,
    layout_spec,
)

Allocator = Callable[[int], int]

#: How a request's block ids lie in the pool.
PATTERNS = ("contiguous", "fragmented", "realistic")
PATTERN_HELP = (
    "contiguous: consecutive ids; fragmented: every other id, shuffled (no two blocks adjacent, "
    "nothing merges across blocks); realistic: runs of 1-8 consecutive ids in random order, as "
    "a busy allocator's free list"
)


@dataclass(frozen=True)
class BenchCase:
    """A model shape with the logical and kernel block sizes a serving engine would use."""

    name: str
    shape: ModelShape
    #: logical block size in tokens; ``None`` keeps the shape's own rule (the hybrid's page size)
    block_size: int | None
    kernel_block_size: int | None
    note: str

    def layout(self, num_blocks: int, allocate: Allocator, num_layers: int | None = None) -> Layout:
        """The layout of one engine holding ``num_blocks`` blocks per cache tensor."""
        spec = layout_spec(
            self.shape,
            num_blocks,
            allocate,
            block_size=self.block_size,
            kernel_block_size=self.kernel_block_size,
            num_layers=num_layers,
        )
        return Layout(spec)

    def blocks_needed(self, prompt_tokens: int, num_layers: int | None = None) -> int:
        """Pool blocks one request of ``prompt_tokens`` takes over all groups (null ids aside)."""
        layout = self.layout(1, bump_allocator(), num_layers)
        tokens = remote_prefill_token_count(prompt_tokens, layout.has_state)
        return sum(
            1 if g.kind is GroupKind.STATE else blocks_for_tokens(tokens, g.block_size)
            for g in layout.groups.values()
        )


CASES: dict[str, BenchCase] = {
    c.name: c
    for c in (
        BenchCase(
            "qwen3.5-hybrid", QWEN35_HYBRID, None, 16,
            "block 544 = 34 kernel blocks of 16 (vLLM sizes the attention page to hold one GDN "
            "state); 1 attention + 3 GDN state groups",
        ),
        BenchCase("deepseek-mla", DEEPSEEK_MLA, 64, None, "block 64, one MLA group"),
        BenchCase("llama3-70b-dense", LLAMA3_DENSE, 16, None, "block 16, K-first layout"),
        BenchCase(
            "gpt-oss-sliding", GPT_OSS_SLIDING, 64, 16,
            "block 64 = 4 kernel blocks of 16; full + sliding-window (128) groups",
        ),
    )
}  # fmt: skip


def pool_order(pattern: str, pool_size: int, rng: np.random.Generator) -> list[int]:
    """Free block ids ``1 .. pool_size-1`` in the order an allocator would hand them out."""
    if pattern == "contiguous":
        return list(range(1, pool_size))
    if pattern == "fragmented":
        return [int(b) for b in rng.permutation(np.arange(1, pool_size, 2))]
    if pattern == "realistic":
        return fragmented_pool(pool_size, rng)
    raise ValueError(f"unknown block-id pattern {pattern!r}; choose from {', '.join(PATTERNS)}")


def pool_size(case: BenchCase, prompt_tokens: int, pattern: str, num_layers: int | None) -> int:
    """Blocks per cache tensor: room for the request, twice over for the every-other-id pattern."""
    needed = case.blocks_needed(prompt_tokens, num_layers)
    return (2 * needed if pattern == "fragmented" else needed + needed // 2) + 16


def request_ids(
    layout: Layout,
    prompt_tokens: int,
    pattern: str,
    rng: np.random.Generator,
    order: Callable[[str, int, np.random.Generator], list[int]] = pool_order,
) -> dict[int, list[int]]:
    """Block ids one engine holds for a request's remote-prefilled tokens
    (``kvbridge.workloads.layouts.draw_request_ids``); ``order`` lists the pool's free ids for
    ``pattern``."""
    pool = order(pattern, min(g.num_blocks for g in layout.groups.values()), rng)
    return draw_request_ids(layout, prompt_tokens, pool)


def source_root() -> Path | None:
    """The source tree (with ``benchmarks/`` and ``tests/``) kvbridge runs from, if any."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "benchmarks").is_dir() and (root / "tests" / "core").is_dir():
            return root
    return None


def load_source_module(relative: str, name: str) -> ModuleType | None:
    """Import a file of the source tree (the reference planner, the raw engine baseline).

    These live in ``tests/`` and ``benchmarks/`` because they are what kvbridge is checked and
    measured against, not part of it; without a source tree the benchmark runs without them.
    """
    if name in sys.modules:
        return sys.modules[name]
    root = source_root()
    path = root / relative if root else None
    if path is None or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module
