"""The one memo of what is derived from a pair of layouts (or of their groups' regions).

Layouts never change once built, so whatever depends only on two of them (the planner's
per-pair templates, the TP restriction of a pair, their compatibility) is built once per pair
and kept while both live: in the second object's ``memo`` dict (so it goes with that object),
under the first one's id, with a weak reference that tells a new object at a recycled id from
the old one. Entries whose first object is gone (a restarted peer's layout) are dropped when
another is added.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class HasMemo(Protocol):
    """An object that never changes once built and keeps a dict of what is derived from it."""

    @property
    def memo(self) -> dict[Any, Any]: ...


S = TypeVar("S")
D = TypeVar("D", bound=HasMemo)
V = TypeVar("V")


class PairMemo(Generic[S, D, V]):
    """``build(src, dst)``, built once per pair of objects and kept in ``dst.memo``.

    A call may pass its own ``build`` (no arguments) for a value that needs more than the pair
    to build (what its errors say, say), though not to tell it from the pair's value.
    """

    def __init__(self, build: Callable[[S, D], V] | None = None) -> None:
        self._build = build

    def __call__(self, src: S, dst: D, build: Callable[[], V] | None = None) -> V:
        memo = dst.memo
        key = (self, id(src))
        found = memo.get(key)
        if found is not None and found[0]() is src:
            value: V = found[1]
            return value
        if build is not None:
            value = build()
        else:
            assert self._build is not None, "a PairMemo without build needs one per call"
            value = self._build(src, dst)
        for gone in [k for k, (ref, _) in memo.items() if ref() is None]:
            del memo[gone]  # objects that are gone (a restarted prefill's layout, say)
        memo[key] = (weakref.ref(src), value)
        return value
