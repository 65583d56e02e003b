"""The connector's options: read from ``kv_transfer_config.kv_connector_extra_config`` and the
environment, each checked for its type and range when the connector starts.

``transport`` (entry-point name, default ``mooncake``), ``transport_options`` (keyword options
of the transport), ``mode`` (``pull`` or ``push``), ``host`` (side channel, ``127.0.0.1``),
``port`` (side channel of TP rank 0, default 5790; TP rank r of pipeline stage s binds
port + s*tp + r, so an engine of TP size tp and pp stages needs ports port..port+pp*tp-1 free
and reachable from the other side), ``timeout`` (s),
``lease`` (s), ``secret`` (shared token authenticating peers), ``kv_split`` (``head_kv`` for
vLLM's CPU attention layout, ``opaque`` otherwise; default from the platform), ``kv_layout``
(the physical KV cache layout to ask vLLM for: ``auto``, or one of vLLM's ``KVCacheLayout``
names such as ``LBHNC`` or ``BLHNC``), ``verify`` (``off``, ``sample``, ``full``: digest what was
moved on both sides; a mismatch fails the load), ``secret_file`` (a file holding ``secret``),
``claim_timeout`` (s: P frees a request no decode claimed this long after publishing; default
from ``lease``), ``max_held_requests`` and ``max_held_fraction`` (P holds at most this many
requests, and this fraction of its KV pool, for decode; past either, P answers but holds
nothing and decode computes the prompt itself), ``insecure`` (true: allow a side channel
reachable from other hosts without a secret, on an isolated network on purpose).

Weak settings stop the connector at start (``kvbridge.control.exposure``): an empty secret, a
``port + rank`` outside 1-65535 for any worker, and a non-loopback ``host`` without a secret
unless ``insecure`` is true.

Every option is checked for its type and range when the connector starts (``Options.from_extra``):
a bad one stops it with one line naming the option, the value and what is expected; an unknown
one with the options there are (and a close match). ``transport_options`` are checked against
the transport's own options there too (``kvbridge.core.registry.check_options``), without
starting its engine. The
environment sets the per-host values and wins over the JSON, which is typically shared by every
instance: ``KVBRIDGE_HOST`` (``host``), ``KVBRIDGE_PORT`` (``port``), ``KVBRIDGE_SECRET`` or
``KVBRIDGE_SECRET_FILE`` (``secret``, replacing both ``secret`` and ``secret_file`` of the JSON).
The secret is never logged nor shown in errors or in ``repr(Options)``. Nothing here imports
vLLM (but for the layout names, when ``kv_layout`` is checked) or the control plane.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvbridge.adapters.vllm.layout import SPLIT_HEAD_KV, SPLIT_OPAQUE
from kvbridge.control.exposure import refuse_weak_settings
from kvbridge.control.requests import Mode, RankAddress, rank_engine_id
from kvbridge.core.errors import TransportOptionError, did_you_mean
from kvbridge.core.integrity import Verify
from kvbridge.core.registry import check_options

log = logging.getLogger("kvbridge.vllm")

DEFAULT_PORT = 5790
SLEEP_MODE_REFUSED = (
    "kvbridge: sleep mode (--enable-sleep-mode) is not supported: sleeping frees and remaps the "
    "KV cache that the transport registered and peers read or write; start P and D without it"
)


#: Environment variables that set an option for one host; they win over the (shared) JSON.
ENV_HOST = "KVBRIDGE_HOST"
ENV_PORT = "KVBRIDGE_PORT"
ENV_SECRET = "KVBRIDGE_SECRET"
ENV_SECRET_FILE = "KVBRIDGE_SECRET_FILE"
#: Every variable the connector reads (``KVBRIDGE_LOG_LEVEL``: ``kvbridge.adapters.vllm.logs``).
ENV_NAMES = (ENV_HOST, "KVBRIDGE_LOG_LEVEL", ENV_PORT, ENV_SECRET, ENV_SECRET_FILE)

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
    "claim_timeout": (_Seconds, math.isfinite, _SECONDS),
    "max_held_requests": (
        Annotated[int, msgspec.Meta(ge=0)],
        None,
        "an integer >= 0 (requests P holds for decode at once)",
    ),
    "max_held_fraction": (
        Annotated[float, msgspec.Meta(ge=0, le=1)],
        None,
        "a number in [0, 1] (the fraction of P's KV blocks held for decode at once)",
    ),
    "insecure": (bool, None, "true or false"),
    "bootstrap_port": (
        Annotated[int, msgspec.Meta(ge=1, le=65535)],
        None,
        "an integer 1-65535 (the port of P's bootstrap /query for vllm-router's mooncake mode)",
    ),
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


def _refuse_env_typos(environ: Mapping[str, str]) -> None:
    """A ``KVBRIDGE_`` variable that is a near miss of one the connector reads (a typo that
    would leave, say, the secret unset) stops it with one line; other names (a test harness's
    own) are left alone."""
    prefix = "KVBRIDGE_"
    suffixes = {name[len(prefix) :]: name for name in ENV_NAMES}
    for name in environ:
        if name.startswith(prefix) and name not in ENV_NAMES:
            close = difflib.get_close_matches(name[len(prefix) :], suffixes, n=1, cutoff=0.75)
            if close:
                raise ValueError(
                    f"kvbridge: environment variable {name} is not one kvbridge reads (did you "
                    f"mean {suffixes[close[0]]}?); rename or unset it (kvbridge reads "
                    f"{', '.join(ENV_NAMES)})"
                )


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
    #: P: how long it holds a request no decode claimed (None: ``Deadlines.claim``)
    claim_timeout: float | None = None
    #: P: the most it holds for decode at once (requests; fraction of its KV pool)
    max_held_requests: int = 1024
    max_held_fraction: float = 0.5
    #: allow a side channel other hosts reach without a secret
    insecure: bool = False
    #: P: serve vllm-router's ``--kv-connector mooncake`` mode: its bootstrap ``/query`` on
    #: ``host``:this port (``kvbridge.router.bootstrap``); None: not served
    bootstrap_port: int | None = None

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
        unknown = [name for name in extra if name not in known]
        if unknown:
            named = ", ".join(f"{name!r}{did_you_mean(str(name), known)}" for name in unknown)
            raise ValueError(
                f"kv_connector_extra_config has no kvbridge option{'s' if len(unknown) > 1 else ''}"
                f" {named}; its options are {', '.join(repr(k) for k in sorted(known))}"
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
        _refuse_env_typos(environ)
        _env_overrides(values, environ)
        secret = _secret(values, environ)
        if "prefill_peers" in values:  # the form P publishes its side channel in
            values["prefill_peers"] = tuple(
                e if e.startswith("tcp://") else f"tcp://{e}" for e in values["prefill_peers"]
            )
        options = cls(**values, secret=secret)
        # A conflicting transport_options.timeout, an option the transport does not take or of
        # the wrong type: at start too, not when the worker builds the transport
        try:
            check_options(options.transport, options.transport_timed())
        except TransportOptionError as err:
            raise TransportOptionError(f"kvbridge option transport_options: {err}") from None
        options.refuse_weak(1)
        return options

    def refuse_weak(self, workers: int) -> None:
        """Stop at start on settings that weaken security or cannot bind: ``WeakSettingError``
        (a ``ValueError``) for an empty secret, ``port + rank`` outside 1-65535 for any of the
        engine's ``workers`` (TP size times pipeline stages), or a non-loopback ``host`` without
        a secret unless ``insecure``."""
        refuse_weak_settings(
            self.host,
            [self.port + rank for rank in range(workers)],
            self.secret,
            insecure=self.insecure,
            where="kvbridge option",
        )

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
    """Stop the engine at start where kvbridge cannot move the KV right: sleep mode.

    Tensor and pipeline parallelism are supported: each worker (a TP rank of a pipeline
    stage) is a peer of its own, and D's workers load their layers' slices from the P workers
    holding them (``kvbridge.core.tp``, ``kvbridge.core.stages``). Sleep mode frees the KV
    cache and maps it anew on wake-up, under the transport's registration and the addresses
    peers plan with (``supports_sleep_mode`` says so to vLLM 0.33; 0.32 does not ask).
    """
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "enable_sleep_mode", False):
        raise ValueError(SLEEP_MODE_REFUSED)


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


def endpoint_of(options: Options, worker: int = 0) -> str:
    """The side-channel address of a worker's control plane (``port + worker``: the TP rank,
    stage-major across pipeline stages, ``LayoutSpec.flat_rank``)."""
    host = f"[{options.host}]" if ":" in options.host else options.host
    return f"tcp://{host}:{options.port + worker}"


def rank_addresses(
    options: Options, engine_id: str, tp_size: int, pp_size: int = 1
) -> list[RankAddress]:
    """How D reaches each of this engine's workers (the TP ranks of each pipeline stage,
    stage-major): what the scheduler puts into the transfer parameters before any worker
    exists (each worker binds ``port + pp_rank * tp_size + tp_rank``)."""
    return [
        RankAddress(
            rank_engine_id(engine_id, flat % tp_size, tp_size, flat // tp_size, pp_size),
            endpoint_of(options, flat),
        )
        for flat in range(pp_size * tp_size)
    ]
