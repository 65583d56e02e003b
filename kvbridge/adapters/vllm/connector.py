"""``KVBridgeConnector``: vLLM's KV connector interface on top of kvbridge's core.

The scheduler side is ``SchedulerState`` (pure bookkeeping); the worker side builds the core
layout from the registered caches, opens a ``ControlPlane`` with the configured transport and
starts publishes, loads and releases without blocking the forward pass. Its options
(``kv_transfer_config.kv_connector_extra_config`` and the environment) are ``options.Options``.
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
    SPLIT_HEAD_KV,
    SPLIT_OPAQUE,
    build_layout_spec,
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
from kvbridge.adapters.vllm.transpose import transpose_received
from kvbridge.control.requests import Mode, TransferParams, rank_engine_id
from kvbridge.core.layout import Layout
from kvbridge.core.registry import load_transport, load_transport_class
from kvbridge.core.transpose import Transpose

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


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """Scheduler → worker: what to start this step."""

    plan: StepPlan = field(default_factory=StepPlan)


def _tp(vllm_config: Any) -> tuple[int, int]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


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
        groups = [
            GroupInfo(
                i,
                group_kind(g.kv_cache_spec),
                int(getattr(g.kv_cache_spec, "num_speculative_blocks", 0) or 0),
                bool(getattr(g, "enable_kv_transfer", True)),
            )
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        ]
        self.scheduler: SchedulerState | None = None
        self.plane: ControlPlane | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._sending: set[str] = set()
        self._recving: dict[str, str] = {}  # P's request id (the plane's key) → D's request id
        self._early: list[str] = []  # publishes that failed: report their blocks free at once
        self._failed_now: set[str] = set()  # loads that could not even start
        self._stats = KVBridgeStats()
        self._unproven_seen: set[str] = set()  # loads held for good, already counted
        if role == KVConnectorRole.SCHEDULER:
            tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
            self.scheduler = SchedulerState(
                groups,
                engine_id=self.engine_id,
                ranks=rank_addresses(self.options, self.engine_id, tp_size),
                transport=self.options.transport,
                mode=self.options.mode,
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
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks before it starts an engine with ``--enable-sleep-mode``: no (sleeping
        remaps the KV cache that the transport registered and peers read or write)."""
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
        assert self.scheduler is not None, "scheduler-side call on a worker connector"
        return self.scheduler

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A load restores every transfer group, STATE included (not only prefix-cacheable ones).
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        ids = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
        self._sched().update_state_after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVBridgeMetadata(self._sched().build_step())

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

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tp_rank, tp_size = _tp(self._vllm_config)
        split = self.options.kv_split
        if split is None:
            from vllm.platforms import current_platform

            split = SPLIT_HEAD_KV if current_platform.is_cpu() else SPLIT_OPAQUE
        cache_config = getattr(self._vllm_config, "cache_config", None)
        engine_layout = getattr(self._kv_cache_config, "kv_cache_layout", None) or getattr(
            cache_config, "kv_cache_layout", None
        )
        model = getattr(self._vllm_config, "model_config", None)
        total_heads = None
        if model is not None and not getattr(model, "use_mla", False):
            total_heads = int(model.get_total_num_kv_heads())
        self._kv_caches = kv_caches
        spec = build_layout_spec(
            self._kv_cache_config,
            kv_caches,
            split=split,
            tp_rank=tp_rank,
            tp_size=tp_size,
            engine_layout=engine_layout,
            total_num_kv_heads=total_heads,
        )
        transport_cls = load_transport_class(self.options.transport)
        options = self.options.transport_timed()
        if transport_cls.host_option is not None:
            # The transport announces the address peers reach it at: the side channel's host
            # unless the transport's own option says otherwise.
            options.setdefault(transport_cls.host_option, self.options.host)
        transport = load_transport(self.options.transport, **options)
        # Imported here: the scheduler process loads this module too and needs no zmq plane.
        from kvbridge.control.plane import ControlPlane

        self.plane = ControlPlane(
            Layout(spec),
            transport,
            engine_id=rank_engine_id(self.engine_id, tp_rank, tp_size),
            host=self.options.host,
            port=self.options.port + tp_rank,
            secret=self.options.secret,
            timeout=self.options.timeout,
            lease=self.options.lease,
            verify=self.options.verify,
        )
        log.info(
            "kvbridge: %s (TP rank %d of %d) registered, side channel %s",
            self.plane.engine_id,
            tp_rank,
            tp_size,
            self.plane.endpoint,
        )
        peers = self.options.prefill_peers
        ktc = self._vllm_config.kv_transfer_config
        if peers and ktc is not None and ktc.is_kv_consumer:
            self.plane.connect_early(peers)
        elif peers:
            log.warning(
                "kvbridge: option prefill_peers is for decode instances; a %s ignores it",
                getattr(ktc, "kv_role", "producer"),
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.plane is None or not isinstance(meta, KVBridgeMetadata):
            return
        self.apply(meta.plan)

    def apply(self, plan: StepPlan) -> None:
        """Start what the scheduler decided; every call here returns without waiting."""
        plane = self.plane
        assert plane is not None, "register_kv_caches first"
        for pub in plan.publishes:
            try:
                plane.publish(pub.request_id, pub.block_ids, pub.num_tokens, Mode(pub.mode))
                self._sending.add(pub.request_id)
            except Exception as err:  # blocks must still be freed, or P leaks them
                log.error("kvbridge: publish of %s failed: %s", pub.request_id, err)
                self._early.append(pub.request_id)
        for load in plan.loads:
            try:
                params = TransferParams.from_dict(load.params)
                self._recving[params.request_id] = load.request_id
                if params.mode is Mode.PUSH:
                    plane.push(params, load.block_ids)
                else:
                    plane.pull(params, load.block_ids)
                log.debug("kvbridge: load of %s started (%s)", load.request_id, params.mode.value)
            except Exception as err:
                log.error("kvbridge: load of %s failed to start: %s", load.request_id, err)
                self._failed_now.add(load.request_id)
        for raw in plan.releases:
            try:
                plane.abort(TransferParams.from_dict(raw), "decode will not load this request")
            except Exception as err:
                log.warning("kvbridge: release not sent (%s); P's lease frees it", err)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request and asynchronous

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # P's bytes stay in place; D reads them (or P writes them on request)

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished sends (P may free) and receives (D may run), failed receives marked.

        Failed loads go through ``failed_recving``: vLLM 0.32 refuses block-level failure
        reports when a model has several cache groups, and recomputes a failed request under
        ``kv_load_failure_policy="recompute"``.
        """
        results = KVConnectorTransferResults()
        if self.plane is None:
            return results
        results.finished_sending.update(self._early)
        self._early.clear()
        failed, self._failed_now = self._failed_now, set()
        for _ in failed:
            self._stats.record_failure()
        for outcome in self.plane.poll_finished():
            rid = outcome.request_id
            if rid in self._sending:
                self._sending.discard(rid)
                results.finished_sending.add(rid)
                if outcome.ok and outcome.stats.nbytes:  # P pushed: the bytes were P's work
                    self._stats.record(outcome.stats)
                elif outcome.stats.lease_expired:  # D never released them: P freed them
                    self._stats.record_lease_expiry()
            elif rid in self._recving:
                local = self._recving.pop(rid)
                if outcome.ok and not self._transpose(local, outcome.transposes):
                    failed.add(local)
                elif outcome.ok:
                    log.debug("kvbridge: load of %s done", local)
                    results.finished_recving.add(local)
                    self._stats.record(outcome.stats)
                else:
                    log.warning("kvbridge: load of %s failed: %s", local, outcome.reason)
                    failed.add(local)
                    self._stats.record_failure(outcome.stats)
        for rid in failed:
            results.finished_recving.add(rid)
            results.failed_recving.add(rid)
        held = len(self.plane.held)
        if held:
            self._stats.record_held(held)
            unproven = set(self.plane.unproven)
            if new := unproven - self._unproven_seen:
                self._stats.record_unproven(len(new))
            self._unproven_seen = unproven
        return results

    def _transpose(self, request_id: str, transposes: list[Transpose]) -> bool:
        """Permute blocks that landed in P's order (P token-major, D head-major or the other
        way round) before vLLM reads them; ``False``: it failed, the load counts as failed."""
        if not transposes:
            return True
        groups = [g.layer_names for g in self._kv_cache_config.kv_cache_groups]
        try:
            transpose_received(self._kv_caches, groups, transposes)
        except Exception as err:  # the blocks hold P's order: recompute them
            log.error("kvbridge: load of %s: transposing its blocks failed: %s", request_id, err)
            return False
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        """This worker's transfers since the last call (vLLM polls it every step)."""
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVBridgeStats()
        return out

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
        if self.plane is not None:
            self.plane.close()
            self.plane = None
