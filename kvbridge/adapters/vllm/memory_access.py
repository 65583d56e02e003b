"""A transport's ``MemoryAccess`` declaration as vLLM's ``KVCacheAccess`` flags (vLLM 0.34+).

vLLM 0.34 asks each KV connector class how it reaches the device KV cache
(``KVConnectorBase_V1.kv_cache_access``) while it builds its config, to decide how its extensible
(virtual-memory) KV cache backs each layer segment: with one physical allocation where the memory
is registered for DMA/RDMA or mapped by another process, as the transports that do so need. The
core's flags say that for a transport without naming vLLM; this is their one translation:

* ``BY_ADDRESS`` (nothing set) -> ``IN_PROCESS``: any allocation works;
* ``REGISTERS`` -> ``REGISTERS``;
* ``EXPORTS_WITHIN_HOST`` -> ``EXPORTS_FABRIC``: another process of the host maps it through UCX
  ``cuda_ipc``, which for driver-mapped memory takes CUDA FABRIC handles (vLLM then wants an
  IMEX channel, and without one keeps the extensible cache off unless asked for it).

vLLM is imported inside the function only: vLLM 0.32 and 0.33 have no ``KVCacheAccess`` and never
ask.
"""

from __future__ import annotations

from typing import Any

from kvbridge.core.contract import MemoryAccess

#: each core flag -> the name of vLLM's ``KVCacheAccess`` flag it means; a flag missing here
#: counts as ``REGISTERS``, the safe answer (``tests/adapters/vllm/test_kv_cache_access.py``
#: checks that every flag has its entry)
VLLM_FLAGS: dict[MemoryAccess, str] = {
    MemoryAccess.REGISTERS: "REGISTERS",
    MemoryAccess.EXPORTS_WITHIN_HOST: "EXPORTS_FABRIC",
}


def kv_cache_access(access: MemoryAccess) -> Any:
    """vLLM's ``KVCacheAccess`` flags for a transport's ``memory_access`` (``IN_PROCESS`` for
    ``BY_ADDRESS``); needs vLLM 0.34 or later."""
    from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined]  # vLLM 0.34

    flags = KVCacheAccess.IN_PROCESS
    for member in MemoryAccess:  # not ``iter(access)``: Python 3.10 has no iteration of a value
        if member.value and member in access:
            flags |= KVCacheAccess[VLLM_FLAGS.get(member, "REGISTERS")]
    return flags
