"""``KVBridgeConnector``: vLLM's KV connector interface on top of kvbridge's core.

The scheduler side is ``SchedulerState`` (pure bookkeeping); the worker side builds the core
layout from the registered caches, opens a ``ControlPlane`` with the configured transport and
starts publishes, loads and releases without blocking the forward pass. Options come from
``kv_transfer_config.kv_connector_extra_config``:

``transport`` (entry-point name, default ``mooncake``), ``transport_options`` (keyword options
of the transport), ``mode`` (``pull`` or ``push``), ``host`` (side channel, ``127.0.0.1``),
``port`` (side channel of TP rank 0, default 5790; TP rank r binds port + r, so an engine of
TP size n needs ports port..port+n-1 free and reachable from the other side), ``timeout`` (s),
``lease`` (s), ``secret`` (shared token authenticating peers), ``kv_split`` (``head_kv`` for
vLLM's CPU attention layout, ``opaque`` otherwise; default from the platform), ``kv_layout``
(the physical KV cache layout to ask vLLM for: ``auto``, or one of vLLM's ``KVCacheLayout``
names such as ``LBHNC`` or ``BLHNC``), ``verify`` (``off``, ``sample``, ``full``: digest what was
moved on both sides; a mismatch fails the load), ``secret_file`` (a file holding ``secret``).

Every option is checked for its type and range when the connector starts (``Options.from_extra``):
a bad one stops it with one line naming the option, the value and what is expected. The
environment sets the per-host values and wins over the JSON, which is typically shared by every
instance: ``KVBRIDGE_HOST`` (``host``), ``KVBRIDGE_PORT`` (``port``), ``KVBRIDGE_SECRET`` or
``KVBRIDGE_SECRET_FILE`` (``secret``, replacing both ``secret`` and ``secret_file`` of the JSON).
The secret is never logged nor shown in errors or in ``repr(Options)``.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
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
from kvbridge.adapters.vllm.prom_metrics import KVBridgePromMetrics
from kvbridge.adapters.vllm.scheduler import GroupInfo, SchedulerState, StepPlan
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.adapters.vllm.transpose import transpose_received
from kvbridge.control.requests import Mode, RankAddress, TransferParams, rank_engine_id
from kvbridge.core.integrity import Verify
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

DEFAULT_PORT = 5790
SLEEP_MODE_REFUSED = (
    "kvbridge: sleep mode (--enable-sleep-mode) is not supported: sleeping frees and remaps the "
    "KV cache that the transport registered and peers read or write; start P and D without it"
)


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """Scheduler → worker: what to start this step."""

    plan: StepPlan = field(default_factory=StepPlan)


#: Environment variables that set an option for one host; they win over the (shared) JSON.
ENV_HOST = "KVBRIDGE_HOST"
ENV_PORT = "KVBRIDGE_PORT"
ENV_SECRET = "KVBRIDGE_SECRET"
ENV_SECRET_FILE = "KVBRIDGE_SECRET_FILE"

_Text = Annotated[str, msgspec.Meta(min_length=1)]
_Seconds = Annotated[float, msgspec.Meta(gt=0)]
_SECONDS = "a finite number of seconds > 0"

#: A prefill side channel as ``prefill_peers`` names it.
_PEER = re.compile(r"(tcp://)?[^\s:/]+:[0-9]{1,5}")

#: Each JSON option but ``kv_layout`` (checked against vLLM's names): the type its value must
#: have (msgspec, strict: no str → int, no bool → int), a further check, and what is expected.
_OPTION_TYPES: dict[str, tuple[Any, Callable[[Any], bool] | None, str]] = {
    "transport": (_Text, None, "a non-empty string (a kvbridge.transports entry-point name)"),
    "transport_options": (dict[str, Any], None, "an object (the transport's keyword options)"),
    "mode": (Mode, None, "'pull' or 'push'"),
    "host": (_Text, None, "a non-empty string (host name or IP address)"),
    "port": (Annotated[int, msgspec.Meta(ge=1, le=65535)], None, "an integer 1-65535"),
    "timeout": (_Seconds, math.isfinite, _SECONDS),
    "lease": (_Seconds, math.isfinite, _SECONDS),
    "secret": (_Text, None, "a non-empty string"),
    "secret_file": (_Text, None, "a non-empty string (a file path)"),
    "kv_split": (
        _Text | None,
        lambda v: v in (None, SPLIT_HEAD_KV, SPLIT_OPAQUE),
        f"{SPLIT_HEAD_KV!r} or {SPLIT_OPAQUE!r}",
    ),
    "verify": (Verify, None, "'off', 'sample' or 'full'"),
    "prefill_peers": (
        tuple[_Text, ...],
        lambda v: all(_PEER.fullmatch(e) and 1 <= int(e.rsplit(":", 1)[1]) <= 65535 for e in v),
        "a list of prefill side channels, each 'host:port' (or 'tcp://host:port')",
    ),
}
#: Options whose value is never shown: not in logs, errors nor ``repr(Options)``.
_HIDDEN = frozenset({"secret"})
_UNSET = object()


def _shown(name: str, value: object) -> str:
    """A value as an error shows it: one short line, a hidden option's only by its type."""
    if name in _HIDDEN:
        return f"<hidden {type(value).__name__}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _checked(name: str, value: object, origin: str | None = None, raw: object = _UNSET) -> Any:
    """An option's value converted to its type, or one line naming what is wrong.

    ``origin`` names the environment variable the value came from, ``raw`` its text.
    """
    kind, check, expected = _OPTION_TYPES[name]
    try:
        converted = msgspec.convert(value, type=kind, strict=True)
        ok = check is None or check(converted)
    except msgspec.ValidationError:
        ok = False
    if not ok:
        shown = _shown(name, value if raw is _UNSET else raw)
        where = f" (from {origin})" if origin else ""
        raise ValueError(f"kvbridge option {name}={shown}{where}: expected {expected}")
    return converted


def _env(environ: Mapping[str, str], name: str) -> str | None:
    """An environment variable, or ``None`` where it is unset; set but empty is an error."""
    value = environ.get(name)
    if value is not None and not value.strip():
        raise ValueError(f"kvbridge: {name} is set but empty; unset it or give a value")
    return value


def _read_secret(path: str, origin: str) -> str:
    """The secret in a file, without its trailing newline; errors name the file, never its text."""
    try:
        text = Path(path).read_bytes().decode()
    except OSError as err:
        problem = f"cannot read it ({err.strerror or type(err).__name__})"
    except UnicodeDecodeError:
        problem = "the file is not UTF-8 text"
    else:
        secret = text.rstrip("\r\n")
        if secret:
            return secret
        problem = "the file is empty"
    raise ValueError(f"kvbridge {origin}={path!r}: {problem}")


def _secret(values: dict[str, Any], environ: Mapping[str, str]) -> str | None:
    """The secret: from ``KVBRIDGE_SECRET``/``_FILE`` if set, else from ``secret``/``secret_file``.

    Each layer takes one of the two; the environment replaces the JSON's whole choice.
    """
    given, path = values.pop("secret", None), values.pop("secret_file", None)
    if given is not None and path is not None:
        raise ValueError("kvbridge options secret and secret_file are both given: give one")
    env_secret, env_path = _env(environ, ENV_SECRET), _env(environ, ENV_SECRET_FILE)
    if env_secret is not None and env_path is not None:
        raise ValueError(f"kvbridge: {ENV_SECRET} and {ENV_SECRET_FILE} are both set: set one")
    if env_secret is None and env_path is None:
        return given if path is None else _read_secret(path, "option secret_file")
    if env_secret is not None:
        origin, secret = ENV_SECRET, str(_checked("secret", env_secret, ENV_SECRET))
    else:
        origin = ENV_SECRET_FILE
        secret = _read_secret(_checked("secret_file", env_path, ENV_SECRET_FILE), origin)
    overridden = " instead of kv_connector_extra_config's" if given or path else ""
    log.info("kvbridge: option secret from %s%s", origin, overridden)
    return secret


def _env_overrides(values: dict[str, Any], environ: Mapping[str, str]) -> None:
    """``KVBRIDGE_HOST`` and ``KVBRIDGE_PORT`` set ``host`` and ``port`` over the JSON's."""
    for name, variable in (("host", ENV_HOST), ("port", ENV_PORT)):
        raw = _env(environ, variable)
        if raw is None:
            continue
        text = raw.strip()
        given: object = int(text) if name == "port" and re.fullmatch(r"[0-9]+", text) else text
        value = _checked(name, given, variable, raw)
        if name in values and values[name] != value:
            log.info(
                "kvbridge: option %s=%r from %s instead of kv_connector_extra_config's %r",
                name,
                value,
                variable,
                values[name],
            )
        values[name] = value


@dataclass(frozen=True)
class Options:
    """The connector's options, read once from ``kv_connector_extra_config`` and the environment.

    Build them with ``from_extra``, which checks every option; ``repr`` hides the secret.
    """

    transport: str = "mooncake"
    transport_options: dict[str, Any] = field(default_factory=dict)
    mode: Mode = Mode.PULL
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    timeout: float = 10.0
    lease: float = 30.0
    secret: str | None = None
    kv_split: str | None = None
    kv_layout: str = "auto"
    verify: Verify = Verify.OFF
    #: D: the prefill side channels (``tcp://host:port``, as P publishes them) it handshakes
    #: with at start, so the first request from each needs no handshake.
    prefill_peers: tuple[str, ...] = ()

    def __repr__(self) -> str:
        shown = (
            f"{name}={'***' if name in _HIDDEN and value is not None else repr(value)}"
            for name, value in ((f, getattr(self, f)) for f in self.__dataclass_fields__)
        )
        return f"Options({', '.join(shown)})"

    @classmethod
    def from_extra(
        cls,
        extra: dict[str, Any] | None,
        default_transport: str | None,
        environ: Mapping[str, str] | None = None,
    ) -> Options:
        """The options of ``extra`` (vLLM's ``kv_connector_extra_config``), each checked.

        ``KVBRIDGE_HOST``, ``KVBRIDGE_PORT`` and ``KVBRIDGE_SECRET``/``KVBRIDGE_SECRET_FILE`` of
        ``environ`` (default: the process's) win over ``extra``. Raises a one-line
        ``ValueError`` naming the first bad option, its value (never the secret's) and what is
        expected.
        """
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        known = set(cls.__dataclass_fields__) | {"secret_file"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kvbridge option(s) {unknown} in kv_connector_extra_config; "
                f"known: {sorted(known)}"
            )
        values: dict[str, Any] = {
            name: _layout_option(value) if name == "kv_layout" else _checked(name, value)
            for name, value in extra.items()
        }
        if default_transport is not None:
            # A per-transport connector name fixes the transport; a conflicting option is a bug.
            given = values.setdefault("transport", default_transport)
            if given != default_transport:
                raise ValueError(
                    f"connector for transport {default_transport!r} configured with "
                    f"transport {given!r}"
                )
        _env_overrides(values, environ)
        secret = _secret(values, environ)
        if "prefill_peers" in values:  # the form P publishes its side channel in
            values["prefill_peers"] = tuple(
                e if e.startswith("tcp://") else f"tcp://{e}" for e in values["prefill_peers"]
            )
        options = cls(**values, secret=secret)
        options.transport_timed()  # a conflicting transport_options.timeout fails at start too
        return options

    def transport_timed(self) -> dict[str, Any]:
        """The transport's options with ``timeout`` set from the connector's one ``timeout``.

        One bound for the whole transfer: the control plane's waits, the transport's deadline
        and (Mooncake) the engine's own ``MC_TRANSFER_TIMEOUT``; two bounds that disagree let
        a side give up while the other still moves bytes.
        """
        options = dict(self.transport_options)
        given = options.setdefault("timeout", self.timeout)
        number = isinstance(given, (int, float)) and not isinstance(given, bool)
        if not number or float(given) != float(self.timeout):
            raise ValueError(
                f"kvbridge option transport_options.timeout={_shown('timeout', given)}: expected "
                f"none or the connector's timeout ({self.timeout}); set only 'timeout' in "
                "kv_connector_extra_config"
            )
        return options


def refuse_unsupported_parallelism(vllm_config: Any) -> None:
    """Stop the engine at start where kvbridge cannot move the KV right: pipeline parallelism,
    sleep mode.

    A pipeline stage holds only its layers; P and D stages would have to pair up layer by
    layer, which the transfer parameters do not say. Tensor parallelism is supported (each TP
    rank is a peer of its own; D's ranks load from the P ranks holding their slices). Sleep mode
    frees the KV cache and maps it anew on wake-up, under the transport's registration and the
    addresses peers plan with (``supports_sleep_mode`` says so to vLLM 0.33; 0.32 does not ask).
    """
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "enable_sleep_mode", False):
        raise ValueError(SLEEP_MODE_REFUSED)
    size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if size > 1:
        raise ValueError(
            f"kvbridge: pipeline_parallel_size={size} is not supported (P/D transfers between "
            "pipeline stages are not implemented); run P and D with pipeline_parallel_size 1 "
            "(tensor_parallel_size may differ between them)"
        )


def _tp(vllm_config: Any) -> tuple[int, int]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


def _layout_option(value: object) -> str:
    """The ``kv_layout`` option checked against vLLM's layout names (case-insensitive)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    names = [layout.name for layout in KVCacheLayout]
    name = value.upper() if isinstance(value, str) else None
    if name == "AUTO":
        return "auto"
    if name not in names:
        raise ValueError(
            f"kvbridge option kv_layout={_shown('kv_layout', value)}: expected 'auto' or one of "
            f"vLLM's layouts {names}"
        )
    return name


def required_layout(options: Options, use_mla: bool) -> str | None:
    """The physical layout kvbridge asks vLLM for (``None``: vLLM's backends choose).

    ``auto`` asks for LBHNC, as vLLM's own NIXL and Mooncake connectors do, except for MLA,
    whose one latent head makes every layout move the same bytes. LBHNC keeps a layer's
    kernel block one dense run (one descriptor per layer and run of blocks), lets vLLM split
    blocks into kernel blocks for any backend, keeps each head's slice dense for transfers
    between different TP sizes, and is the only layout vLLM's CPU backend allows. The
    block-outermost BLHNC moves a run of blocks of every layer in one descriptor, but vLLM
    cannot split its blocks into kernel blocks; ask for it explicitly where the backend takes
    the manager block size. Whatever vLLM resolves (a backend or ``VLLM_KV_CACHE_LAYOUT`` may
    override the wish), the layout is read from the caches and checked against the peer's.
    """
    if options.kv_layout != "auto":
        return options.kv_layout
    return None if use_mla else "LBHNC"


def endpoint_of(options: Options, tp_rank: int = 0) -> str:
    """The side-channel address of a TP rank's control plane (``port + tp_rank``)."""
    host = f"[{options.host}]" if ":" in options.host else options.host
    return f"tcp://{host}:{options.port + tp_rank}"


def rank_addresses(options: Options, engine_id: str, tp_size: int) -> list[RankAddress]:
    """How D reaches each of this engine's TP ranks: what the scheduler puts into the transfer
    parameters before any worker exists (each worker binds ``port + tp_rank``)."""
    return [
        RankAddress(rank_engine_id(engine_id, rank, tp_size), endpoint_of(options, rank))
        for rank in range(tp_size)
    ]


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
