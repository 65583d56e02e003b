"""What differs between the vLLM releases kvbridge supports (0.32, 0.33, 0.34), in one place,
and every private field of vLLM's that kvbridge reads or writes.

- 0.33 moved the KV cache planning functions from ``vllm.v1.core.kv_cache_utils`` to
  ``vllm.v1.core.kv_cache_planning`` without re-exporting them; callers import them from here.
- 0.34 removed ``CachedRequestData.resumed_req_ids``: a preempted request comes back in
  ``scheduled_new_reqs`` with its whole block table (``resumed_req_ids`` says which cached
  requests resumed on 0.32/0.33, and is empty on 0.34).
- Private fields: ``Request._all_token_ids`` (P cuts its prompt to the tokens it prefills) and
  ``KVConnectorFactory._registry`` (the plugin registers each connector name once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: The vLLM releases (major, minor) kvbridge is tested with, oldest and newest.
TESTED = ((0, 32), (0, 34))


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


def resumed_req_ids(cached_reqs: Any) -> set[str]:
    """The cached requests of a step that resumed after a preemption (vLLM 0.32 and 0.33's
    ``CachedRequestData.resumed_req_ids``); empty on 0.34, which sends them as new requests."""
    return set(getattr(cached_reqs, "resumed_req_ids", ()) or ())


def drop_prompt_tail(request: Any, count: int) -> None:
    """Remove the last ``count`` prompt tokens of a request vLLM has not scheduled yet: from its
    prompt and from the token list vLLM counts and hashes (the private ``_all_token_ids``)."""
    if count <= 0:
        return
    del request.prompt_token_ids[-count:]
    del request._all_token_ids[-count:]
    request.num_prompt_tokens = len(request.prompt_token_ids)


def registered_connectors() -> Iterable[str]:
    """The connector names vLLM's factory knows (its private ``_registry``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return tuple(KVConnectorFactory._registry)


def untested_release(version: str) -> str | None:
    """A one-line warning when ``version`` (vLLM's ``__version__``) is outside the releases
    kvbridge is tested with, else ``None``. A warning, not a refusal: a new release usually
    works, and ``make test-vllm-latest`` says whether it does."""
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None  # a development build: nothing to compare
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED
    if TESTED[0] <= release <= TESTED[1]:
        return None
    return (
        f"kvbridge is tested with vLLM {lo_major}.{lo_minor} to {hi_major}.{hi_minor}, not "
        f"{version}: its connector may work, but nothing proved it (make test-vllm-latest "
        "runs the adapter's tests on the newest release)"
    )
