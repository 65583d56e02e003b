"""The one memo per pair of layouts: built once per pair, kept while both live."""

from __future__ import annotations

import gc
from functools import cached_property
from typing import Any

from kvbridge.core.memo import PairMemo


class Thing:
    @cached_property
    def memo(self) -> dict[Any, Any]:
        return {}


def test_a_pair_is_built_once_and_a_gone_source_is_dropped():
    calls: list[int] = []

    def build(src: Thing, dst: Thing) -> int:
        calls.append(id(src))  # not src itself: the memo must not keep it alive
        return len(calls)

    memo: PairMemo[Thing, Thing, int] = PairMemo(build)
    other: PairMemo[Thing, Thing, int] = PairMemo(build)
    a, d = Thing(), Thing()
    assert memo(a, d) == memo(a, d) == 1 and len(calls) == 1
    assert other(a, d) == 2  # each memo keeps its own value
    assert memo(a, d, lambda: 99) == 1  # found: the call's own build is not used
    del a
    gc.collect()
    b = Thing()
    assert memo(b, d) == 3
    assert len(d.memo) == 1  # both entries of the gone source went
