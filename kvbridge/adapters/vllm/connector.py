"""``KVBridgeConnector``: vLLM's KV connector interface on top of kvbridge's core.

A facade, as vLLM's own NIXL connector is: the scheduler side is ``SchedulerState`` (pure
bookkeeping, ``scheduler.py``), the worker side ``ConnectorWorker`` (the control plane and the
requests in flight, ``worker.py``), the options ``Options`` (``options.py``). This module maps
vLLM's calls onto them and answers vLLM's class-level questions (layout, sleep mode, stats).

vLLM builds one connector per role: in the scheduler's process with ``SCHEDULER``, in each
worker with ``WORKER``. Each builds the side of its role only (``scheduler`` or ``worker``; the
other is ``None``); a call of the other side's (which vLLM never makes) raises ``RuntimeError``
naming the role, except the queries each role answers (stats, ``plane``, ``shutdown``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvbridge.adapters.vllm.layout import (
    group_kind,
)
from kvbridge.adapters.vllm.options import (
    Options,
    rank_addresses,
    refuse_unsupported_parallelism,
    required_layout,
)
from kvbridge.adapters.vllm.prom_metrics import KVBridgePromMetrics
from kvbridge.adapters.vllm.scheduler import GroupInfo, SchedulerState, StepPlan
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.adapters.vllm.worker import ConnectorWorker
from kvbridge.control.holds import HoldBudget, HoldLimits
from kvbridge.core.block_mapping import sliding_window_blocks
from kvbridge.router.bootstrap import BootstrapServer, query_answer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvbridge.control.plane import ControlPlane

log = logging.getLogger("kvbridge.vllm")


def _window_blocks(spec: Any) -> int | None:
    """The blocks a sliding-window group keeps (None for other groups)."""
    window = getattr(spec, "sliding_window", None)
    if not window:
        return None
    return sliding_window_blocks(int(window), int(spec.block_size))


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """Scheduler → worker: what to start this step."""

    plan: StepPlan = field(default_factory=StepPlan)


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvbridge; the transport comes from ``kv_connector_extra_config``."""

    #: Set by the per-transport subclasses the plugin creates (``KVBridgeConnector-<name>``).
    default_transport: str | None = None

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ValueError("KVBridgeConnector needs vLLM's kv_transfer_config")
        self.options = Options.from_extra(ktc.kv_connector_extra_config, self.default_transport)
        refuse_unsupported_parallelism(vllm_config)
        self.engine_id = str(ktc.engine_id)
        #: The scheduler side's state (the scheduler role's connector only).
        self.scheduler: SchedulerState | None = None
        #: The worker side's state (the worker role's connector only); it opens its control
        #: plane at ``register_kv_caches``.
        self.worker: ConnectorWorker | None = None
        self._bootstrap: BootstrapServer | None = None
        self._declined_seen = self._held_blocks_seen = 0  # what the last stats reported
        self._limit_sent = False
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        self.options.refuse_weak(pp_size * tp_size)  # port + rank for every worker
        if role != KVConnectorRole.SCHEDULER:
            self.worker = ConnectorWorker(
                self.options, self.engine_id, vllm_config, kv_cache_config
            )
        else:
            self.scheduler = self._scheduler_state(kv_cache_config, tp_size, pp_size)
            if self.options.bootstrap_port is not None and ktc.is_kv_producer:
                self._bootstrap = BootstrapServer(
                    self.options.host,
                    self.options.bootstrap_port,
                    query_answer(self.engine_id, self.scheduler.prefill_address()),
                )

    def _scheduler_state(
        self, kv_cache_config: KVCacheConfig, tp_size: int, pp_size: int
    ) -> SchedulerState:
        """The scheduler side: the cache groups, P's hold budget, every rank's address."""
        groups = [
            GroupInfo(
                i,
                group_kind(g.kv_cache_spec),
                int(getattr(g.kv_cache_spec, "num_speculative_blocks", 0) or 0),
                bool(getattr(g, "enable_kv_transfer", True)),
                _window_blocks(g.kv_cache_spec),
                int(getattr(g.kv_cache_spec, "block_size", 0) or 0),
            )
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        ]
        limits = HoldLimits.of_pool(
            int(kv_cache_config.num_blocks),
            self.options.max_held_fraction,
            self.options.max_held_requests,
        )
        log.info(
            "kvbridge: prefill holds at most %d requests and %d of its %d KV blocks for "
            "decode (max_held_requests, max_held_fraction)",
            limits.max_requests,
            limits.max_blocks,
            int(kv_cache_config.num_blocks),
        )
        return SchedulerState(
            groups,
            engine_id=self.engine_id,
            ranks=rank_addresses(self.options, self.engine_id, tp_size, pp_size),
            transport=self.options.transport,
            mode=self.options.mode,
            holds=HoldBudget(limits),
            pp_size=pp_size,
        )

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Yes: D may count its full-attention prefix hit even where its recurrent state lags.

        In a hybrid's ``align`` mode D caches the attention blocks of a loaded prompt but never
        the state at their boundary (it loaded the state after token N-2, it did not compute
        the boundary), so without this a repeated prompt hits nothing and is loaded whole. The
        hit is safe for kvbridge because every load carries P's running state after N-1 tokens
        into D's running slot whatever D's hit (``transfer_block_ids``); vLLM falls back to the
        hit all groups share when nothing is loaded, and a failed load recomputes from 0.
        """
        return True

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34 asks under EAGLE's block drop whether the last block hashes may read the
        drafter's lookahead tokens: no, vLLM's default. Lookahead hashing changes which
        prompt blocks count as complete on P and on D, and speculative decoding's draft KV is
        not yet proven through kvbridge; with no, vLLM hashes without lookahead, as it does
        for every connector that does not say yes."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks before it starts an engine with ``--enable-sleep-mode``: no (sleeping
        remaps the KV cache that the transport registered and peers read or write)."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34 asks while it builds its config how the workers reach the device KV cache
        (``KVCacheAccess`` flags), to back each segment of its extensible KV cache with one
        physical allocation where the transport registers or exports it: the configured
        transport's ``memory_access``, translated (``memory_access.py``). Its class is loaded,
        never built (no engine starts).

        vLLM asks it in its API server process before any engine starts, so this is where a
        wrong setting (an option, the transport's name, a missing engine) stops ``vllm serve``
        in one line with exit 2 (``preflight.check_vllm_config``), not after the model loaded.
        """
        from kvbridge.adapters.vllm.memory_access import kv_cache_access
        from kvbridge.adapters.vllm.preflight import check_vllm_config
        from kvbridge.core.registry import load_transport_class

        options = check_vllm_config(kv_transfer_config)
        if options is None:  # loaded under a name of its own (``kv_connector_module_path``)
            extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
            options = Options.from_extra(extra, cls.default_transport)
        return kv_cache_access(load_transport_class(options.transport).memory_access)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM 0.32 and 0.33 ask this in their API server process when full CUDA graphs are
        on, before any engine starts: kvbridge checks its settings there, as in
        ``kv_cache_access`` on 0.34. The answer stays the base class's (False)."""
        from types import SimpleNamespace

        from kvbridge.adapters.vllm.plugin import connector_name
        from kvbridge.adapters.vllm.preflight import check_vllm_config

        config = SimpleNamespace(
            kv_connector=connector_name(cls.default_transport),
            kv_connector_extra_config=extra_config,
        )
        check_vllm_config(config)
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        ktc = vllm_config.kv_transfer_config
        extra = ktc.kv_connector_extra_config if ktc is not None else None
        options = Options.from_extra(extra, cls.default_transport)
        refuse_unsupported_parallelism(vllm_config)  # the engine core asks before any worker
        model = vllm_config.model_config
        layout = required_layout(options, bool(model is not None and model.use_mla))
        log.info("kvbridge: asking vLLM for the %s KV cache layout", layout or "backends' own")
        return layout

    # -- scheduler side ---------------------------------------------------------------------------
    def _sched(self) -> SchedulerState:
        if self.scheduler is None:
            raise RuntimeError("KVBridgeConnector: a scheduler-side call on a worker connector")
        return self.scheduler

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34 (with ``--max-num-inflight-kv-loads``): exactly the requests that may
        load, so a request prefilled here never waits for a load's slot."""
        return self._sched().may_load_async(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A load restores every transfer group, STATE included (not only prefix-cacheable ones).
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        ids = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
        self._sched().update_state_after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVBridgeMetadata(self._sched().build_step(scheduler_output))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.finished_sending(set(connector_output.finished_sending or ()))

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until queued publishes reach the worker.
        return self.scheduler is not None and self.scheduler.has_pending_publish

    # -- worker side: the ConnectorWorker does the work ------------------------------------------
    def _work(self) -> ConnectorWorker:
        if self.worker is None:
            raise RuntimeError("KVBridgeConnector: a worker-side call on the scheduler connector")
        return self.worker

    @property
    def plane(self) -> ControlPlane | None:
        """The worker's control plane (``None`` before ``register_kv_caches`` and on the
        scheduler)."""
        return self.worker.plane if self.worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        worker, meta = self._work(), self._connector_metadata
        if worker.plane is None or not isinstance(meta, KVBridgeMetadata):
            return
        worker.apply(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request and asynchronous

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """After each attention layer's forward (vLLM calls it for attention and MLA layers,
        not for GDN/Mamba ones): P streams the layer to the decode instances of the requests
        whose prefill ends in this step (the concurrent dispatch); otherwise P's bytes stay in
        place until D reads them (or asks P to write them)."""
        meta = self._connector_metadata
        if isinstance(meta, KVBridgeMetadata) and meta.plan.layerwise:
            self._work().stream_layer(layer_name, meta.plan.layerwise)

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished sends (P may free) and receives (D may run), failed receives marked."""
        return self._work().get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        """This worker's transfers since the last call (vLLM polls it every step); on the
        scheduler, P's holds: prefills declined past the hold limit, blocks held for decode."""
        if self.scheduler is None:
            return self._work().take_stats()
        holds = self.scheduler.holds
        if holds is None:
            return None
        declined, self._declined_seen = holds.declined - self._declined_seen, holds.declined
        if not declined and holds.peak_blocks == self._held_blocks_seen and self._limit_sent:
            return None
        self._held_blocks_seen, self._limit_sent = holds.peak_blocks, True
        stats = KVBridgeStats()
        stats.record_holds(declined, holds.peak_blocks, holds.limits.max_blocks)
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data)) if data else KVBridgeStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBridgePromMetrics:
        """vLLM's Prometheus logger (API server) records each step's stats data through this."""
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self._bootstrap is not None:
            self._bootstrap.close()
