"""Pipeline stages: what two workers of engines split into stages have in common.

An engine run with pipeline parallelism gives each stage's workers the cache of that stage's
layers only, named by their global index, and one block table for all stages (a block id names
the same tokens on every stage). A source worker and a destination worker therefore move the
layers both hold, with the same block ids as between two whole engines: the pair is each
layout restricted to those layers. Whether every layer of the destination is held by some
source stage is the coverage check's question (``kvbridge.core.rank_slices.check_coverage``).
"""

from __future__ import annotations

import msgspec

from kvbridge.core.layout import Layout
from kvbridge.core.memo import PairMemo


def staged(layout: Layout) -> bool:
    """Whether ``layout`` is one stage of an engine split into pipeline stages."""
    return layout.spec.pp_size > 1


def layer_names(layout: Layout) -> frozenset[str]:
    """The layers a worker registered."""
    return frozenset(t.layer_name for t in layout.spec.tensors)


def only_layers(
    layout: Layout, layers: frozenset[str], stage: tuple[int, int] | None = None
) -> Layout:
    """``layout`` with the tensors of ``layers`` alone (and the groups they are in), at the
    same addresses; ``stage``: ``(pp_rank, pp_size)`` of the result, by default ``layout``'s."""
    spec = layout.spec
    tensors = [t for t in spec.tensors if t.layer_name in layers]
    used = {t.group_index for t in tensors}
    pp_rank, pp_size = stage or (spec.pp_rank, spec.pp_size)
    groups = [g for g in spec.groups if g.index in used]
    return Layout(
        msgspec.structs.replace(
            spec, groups=groups, tensors=tensors, pp_rank=pp_rank, pp_size=pp_size
        )
    )


def _build_stage_pair(src: Layout, dst: Layout) -> tuple[Layout, Layout] | bool:
    """The restricted pair; ``True``: both hold the same layers; ``False``: none in common.
    Kept in ``dst.memo``, so it never holds ``src`` itself (a restarted peer's layout)."""
    a, b = layer_names(src), layer_names(dst)
    if a == b:
        return True
    common = a & b
    if not common:
        return False
    return only_layers(src, common), only_layers(dst, common)


#: Built once per pair of layouts, like every other pair-derived value.
_STAGE_PAIRS: PairMemo[Layout, Layout, tuple[Layout, Layout] | bool] = PairMemo(_build_stage_pair)


def stage_pair(src: Layout, dst: Layout) -> tuple[Layout, Layout] | None:
    """``src`` and ``dst`` restricted to the layers both hold where either is a pipeline
    stage (the given objects where they hold the same layers, or neither is a stage; else two
    new ones); ``None`` when two stages share no layer (nothing moves between them)."""
    if not (staged(src) or staged(dst)):
        return src, dst
    found = _STAGE_PAIRS(src, dst)
    if found is True:
        return src, dst
    if found is False:
        return None
    return found
