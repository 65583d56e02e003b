"""``KVBridgeConnector`` with ``faults.install`` applied in every process vLLM creates it in.

vLLM's CPU platform spawns its workers, so a patch made before the engine starts does not reach
them; vLLM's own way to load a connector from a module (``kv_connector_module_path``) does. The
fault directory comes from ``KVBRIDGE_TEST_FAULTS`` (spawned processes inherit the environment).
``install`` runs where the worker registers its KV caches, just before the connector loads its
transport (``register_kv_caches``), so the scheduler's process never imports a transport.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvbridge.adapters.vllm.connector import KVBridgeConnector
from tests.adapters.vllm.e2e import faults


class FaultyKVBridgeConnector(KVBridgeConnector):
    """The real connector; its transport and outcomes pass through ``faults``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._fault_role = str(vllm_config.kv_transfer_config.kv_role)

    def register_kv_caches(self, kv_caches: Any) -> None:
        directory = os.environ.get(faults.ENV)
        if directory:
            faults.install(Path(directory), self._fault_role, self.options.transport)
        super().register_kv_caches(kv_caches)
