"""Test-only: let vLLM 0.34's Python layer build its configs on an x86 CPU without triton-cpu.

vLLM 0.34's ``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs requires Triton
(triton-cpu)" where 0.33 only warned, and no triton-cpu exists on the package registry. The
adapter's non-engine tests build ``VllmConfig`` objects (never a model runner, which is what
needs Triton), so for them the check goes back to 0.33's behaviour: Triton counts as present
for the length of that one call. Nothing of this reaches users: kvbridge never patches vLLM,
and the engines that run end to end are vLLM 0.32's CPU build, which has its kernels.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

_applied = False


@contextlib.contextmanager
def _triton_counted_present() -> Iterator[None]:
    import vllm.triton_utils as triton_utils

    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = had


def allow_x86_without_triton() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` once per process, only where it would
    refuse: vLLM 0.34 or later without Triton (0.32's and 0.33's are left as they are)."""
    global _applied
    if _applied:
        return
    _applied = True
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if triton_utils.HAS_TRITON or vllm_release() < (0, 34):
        return
    check: Callable[..., Any] = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    @functools.wraps(check)
    def checked_as_before(cls: type, vllm_config: Any) -> None:
        with _triton_counted_present():
            check(cls, vllm_config)

    CpuPlatform.check_and_update_config = classmethod(checked_as_before)  # type: ignore[method-assign,assignment]


def vllm_release() -> tuple[int, int]:
    """The installed vLLM's (major, minor)."""
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)
