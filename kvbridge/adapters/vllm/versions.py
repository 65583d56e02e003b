"""What differs between the vLLM releases kvbridge supports (0.32 and 0.33), in one place.

vLLM 0.33 moved the KV cache planning functions from ``vllm.v1.core.kv_cache_utils`` to
``vllm.v1.core.kv_cache_planning`` without re-exporting them; callers import them from here.
"""

from __future__ import annotations

from typing import Any


def kv_cache_planning() -> Any:
    """The module holding ``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups``."""
    try:
        from vllm.v1.core import kv_cache_planning as module  # type: ignore[attr-defined]  # 0.33
    except ImportError:
        from vllm.v1.core import kv_cache_utils as module  # vLLM 0.32
    return module


def get_kv_cache_groups(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``get_kv_cache_groups`` (grouping of the layers' cache specs)."""
    return kv_cache_planning().get_kv_cache_groups(*args, **kwargs)


def get_kv_cache_config_from_groups(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``get_kv_cache_config_from_groups`` (placement of the groups in memory)."""
    return kv_cache_planning().get_kv_cache_config_from_groups(*args, **kwargs)
