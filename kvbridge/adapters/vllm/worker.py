"""The connector's worker side: one per TP rank, in vLLM's worker process.

It builds the core layout from the caches vLLM registers, opens the ``ControlPlane`` with the
configured transport, starts the publishes, loads and releases the scheduler decided (none of
them waits), and reports what finished, with its statistics. ``KVBridgeConnector`` is the facade
vLLM calls; this is where the worker's state lives.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvbridge.adapters.vllm.layout import SPLIT_HEAD_KV, SPLIT_OPAQUE, build_layout_spec
from kvbridge.adapters.vllm.options import Options
from kvbridge.adapters.vllm.scheduler import LayerwiseStep, StepPlan
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.adapters.vllm.transpose import transpose_received
from kvbridge.control.requests import Mode, TransferParams, rank_engine_id
from kvbridge.core.layout import Layout, LayoutSpec
from kvbridge.core.registry import load_transport_class
from kvbridge.core.transpose import Transpose

if TYPE_CHECKING:
    from kvbridge.control.plane import ControlPlane
    from kvbridge.core.transport import Transport

log = logging.getLogger("kvbridge.vllm")


def _tp(vllm_config: Any) -> tuple[int, int]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


def _pp(vllm_config: Any) -> tuple[int, int]:
    """This worker's pipeline stage and the engine's stage count."""
    size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_pp_group

    return int(get_pp_group().rank_in_group), size


class ConnectorWorker:
    """The worker side of ``KVBridgeConnector``: its control plane and the requests in flight."""

    def __init__(self, options: Options, engine_id: str, vllm_config: Any, kv_cache_config: Any):
        self.options = options
        self.engine_id = engine_id
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.plane: ControlPlane | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._sending: dict[str, str] = {}  # the plane's id of a published request → vLLM's
        self._recving: dict[str, str] = {}  # P's request id (the plane's key) → D's request id
        self._early: list[str] = []  # publishes that failed: report their blocks free at once
        self._failed_now: set[str] = set()  # loads that could not even start
        self._stats = KVBridgeStats()
        self._unproven_seen: set[str] = set()  # loads held for good, already counted

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tp_rank, tp_size = _tp(self.vllm_config)
        pp_rank, pp_size = _pp(self.vllm_config)
        self._kv_caches = kv_caches
        spec = self._layout_spec(kv_caches, tp_rank, tp_size, pp_rank, pp_size)
        transport = self._transport()
        # Imported here: the scheduler process loads this module too and needs no zmq plane.
        from kvbridge.control.plane import ControlPlane

        self.plane = ControlPlane(
            Layout(spec),
            transport,
            engine_id=rank_engine_id(self.engine_id, tp_rank, tp_size, pp_rank, pp_size),
            host=self.options.host,
            port=self.options.port + pp_rank * tp_size + tp_rank,
            secret=self.options.secret,
            timeout=self.options.timeout,
            lease=self.options.lease,
            claim_timeout=self.options.claim_timeout,
            verify=self.options.verify,
            insecure=self.options.insecure,
        )
        log.info(
            "kvbridge: %s (TP rank %d of %d, pipeline stage %d of %d) registered, side channel %s",
            self.plane.engine_id,
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
            self.plane.endpoint,
        )
        peers = self.options.prefill_peers
        ktc = self.vllm_config.kv_transfer_config
        if peers and ktc is not None and ktc.is_kv_consumer:
            self.plane.connect_early(peers)
        elif peers:
            log.warning(
                "kvbridge: option prefill_peers is for decode instances; a %s ignores it",
                getattr(ktc, "kv_role", "producer"),
            )

    def _layout_spec(
        self,
        kv_caches: dict[str, torch.Tensor],
        tp_rank: int,
        tp_size: int,
        pp_rank: int,
        pp_size: int,
    ) -> LayoutSpec:
        """The layout of the caches vLLM registered, as this rank holds them."""
        split = self.options.kv_split
        if split is None:
            from vllm.platforms import current_platform

            split = SPLIT_HEAD_KV if current_platform.is_cpu() else SPLIT_OPAQUE
        cache_config = getattr(self.vllm_config, "cache_config", None)
        engine_layout = getattr(self.kv_cache_config, "kv_cache_layout", None) or getattr(
            cache_config, "kv_cache_layout", None
        )
        model = getattr(self.vllm_config, "model_config", None)
        total_heads = None
        if model is not None and not getattr(model, "use_mla", False):
            total_heads = int(model.get_total_num_kv_heads())
        return build_layout_spec(
            self.kv_cache_config,
            kv_caches,
            split=split,
            tp_rank=tp_rank,
            tp_size=tp_size,
            engine_layout=engine_layout,
            total_num_kv_heads=total_heads,
            pp_rank=pp_rank,
            pp_size=pp_size,
        )

    def _transport(self) -> Transport:
        """The configured transport, built with the adapter's defaults for its options."""
        transport_cls = load_transport_class(self.options.transport)
        vllm_cache = getattr(self.vllm_config, "cache_config", None)
        if getattr(vllm_cache, "enable_extensible_kv_cache", False):
            # vLLM 0.34's extensible KV cache: the driver maps these caches (CUDA virtual
            # memory); the engine picks a registration path that takes them before it starts.
            transport_cls.prepare_for_driver_mapped_memory()
        options = self.options.transport_timed()
        if transport_cls.host_option is not None:
            # The transport announces the address peers reach it at: the side channel's host
            # unless the transport's own option says otherwise.
            options.setdefault(transport_cls.host_option, self.options.host)
        return transport_cls(**options)

    def apply(self, plan: StepPlan) -> None:
        """Start what the scheduler decided; every call here returns without waiting."""
        plane = self.plane
        assert plane is not None, "register_kv_caches first"
        for pub in plan.publishes:
            try:
                plane.publish(
                    pub.plane_id,
                    pub.block_ids,
                    pub.num_tokens,
                    Mode(pub.mode),
                    pub.token or None,
                    pub.published_at or None,
                )
                self._sending[pub.plane_id] = pub.request_id
            except Exception as err:  # blocks must still be freed, or P leaks them
                log.error("kvbridge: publish of %s failed: %s", pub.request_id, err)
                self._early.append(pub.request_id)
        for load in plan.loads:
            try:
                params = TransferParams.from_dict(load.params)
                self._recving[params.request_id] = load.request_id
                if params.mode is Mode.PUSH:
                    plane.push(params, load.block_ids, load.first_token)
                else:
                    plane.pull(params, load.block_ids, load.first_token)
                log.debug("kvbridge: load of %s started (%s)", load.request_id, params.mode.value)
            except Exception as err:
                log.error("kvbridge: load of %s failed to start: %s", load.request_id, err)
                self._failed_now.add(load.request_id)
        for gone in plan.withdrawals:
            try:
                plane.withdraw(gone.transfer_id, gone.token, gone.reason)
            except Exception as err:  # D then fails its load at its deadline: time, not bytes
                log.warning("kvbridge: withdrawal of %s not sent: %s", gone.transfer_id, err)
        for raw in plan.releases:
            try:
                plane.abort(TransferParams.from_dict(raw), "decode will not load this request")
            except Exception as err:
                log.warning("kvbridge: release not sent (%s); P's lease frees it", err)

    def stream_layer(self, layer_name: str, steps: list[LayerwiseStep]) -> None:
        """P, between two layers of the forward pass: write this layer of the blocks each
        request of the concurrent dispatch completed in this step to the decode ranks that asked
        for it, or tell them (a layer its plan lacks writes nothing). Never raises (the forward
        pass goes on; a failed write fails the push at publish, fenced)."""
        plane = self.plane
        if plane is None:
            return
        for step in steps:
            try:
                plane.stream(
                    step.transfer_id,
                    step.token,
                    step.block_ids,
                    (layer_name,),
                    step.first,
                    step.total,
                )
            except Exception as err:
                log.warning(
                    "kvbridge: layer %s of %s not streamed: %s", layer_name, step.transfer_id, err
                )

    def get_transfer_results(self) -> KVConnectorTransferResults:
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
                results.finished_sending.add(self._sending.pop(rid))
                if outcome.ok and outcome.stats.nbytes:  # P pushed: the bytes were P's work
                    self._stats.record(outcome.stats)
                elif outcome.stats.lease_expired:  # D never released them: P freed them
                    self._stats.record_lease_expiry(unclaimed=outcome.stats.unclaimed)
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
        groups = [g.layer_names for g in self.kv_cache_config.kv_cache_groups]
        try:
            transpose_received(self._kv_caches, groups, transposes)
        except Exception as err:  # the blocks hold P's order: recompute them
            log.error("kvbridge: load of %s: transposing its blocks failed: %s", request_id, err)
            return False
        return True

    def take_stats(self) -> KVBridgeStats | None:
        """This worker's transfers since the last call (vLLM polls it every step)."""
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVBridgeStats()
        return out

    def shutdown(self) -> None:
        if self.plane is not None:
            self.plane.close()
            self.plane = None
