"""Discovery of transports through the entry-point group ``kvbridge.transports`` (stevedore)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stevedore import ExtensionManager
from stevedore.exception import NoMatches

from kvbridge.core.errors import (
    TransportError,
    TransportNotFoundError,
    TransportUnavailableError,
)
from kvbridge.core.transport import Transport

NAMESPACE = "kvbridge.transports"


@dataclass(frozen=True)
class TransportInfo:
    """One installed transport as ``kvbridge transports`` shows it."""

    name: str
    package: str
    usable: bool
    reason: str = ""


def _manager() -> ExtensionManager[Any]:
    # Import failures are recorded, not raised: one broken plugin must not hide the others.
    failures: dict[str, BaseException] = {}

    def on_failure(_mgr: Any, ep: Any, err: BaseException) -> None:
        failures[ep.name] = err

    # stevedore keeps entry points per namespace for the life of the process; drop them so a
    # transport installed (or removed) since the last look is seen. Its on-disk cache, keyed by
    # sys.path and file times, still makes the lookup cheap.
    ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)
    mgr: ExtensionManager[Any] = ExtensionManager(
        namespace=NAMESPACE,
        invoke_on_load=False,
        on_load_failure_callback=on_failure,
    )
    mgr.kvbridge_failures = failures  # type: ignore[attr-defined]
    return mgr


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=NAMESPACE)}


def _package_of(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "?"


def _unavailable_reason(cls: type[Transport]) -> str | None:
    try:
        cls.check_available()
    except TransportUnavailableError as err:
        return str(err)
    return None


def available_transports() -> list[TransportInfo]:
    """Every transport installed in the entry-point group, usable or not, sorted by name."""
    mgr = _manager()
    eps = _entry_points()
    loaded = {ext.name: ext.plugin for ext in mgr}
    failures: dict[str, BaseException] = mgr.kvbridge_failures  # type: ignore[attr-defined]
    infos = []
    for name in sorted(eps):
        package = _package_of(eps[name])
        if name in loaded:
            reason = _unavailable_reason(loaded[name])
            infos.append(TransportInfo(name, package, reason is None, reason or ""))
        else:
            err = failures.get(name)
            infos.append(TransportInfo(name, package, False, f"cannot import plugin: {err}"))
    return infos


def load_transport_class(name: str) -> type[Transport]:
    """The transport class installed under ``name``, checked for a usable engine."""
    mgr = _manager()
    failures: dict[str, BaseException] = mgr.kvbridge_failures  # type: ignore[attr-defined]
    if name in failures:
        raise TransportUnavailableError(
            f"transport {name!r} is installed but its plugin cannot be imported: {failures[name]}"
        )
    try:
        cls = mgr[name].plugin
    except (KeyError, NoMatches):
        installed = ", ".join(sorted(_entry_points())) or "none"
        raise TransportNotFoundError(
            f"no transport named {name!r}; installed transports: {installed}. "
            f"A transport is a package that declares an entry point in the {NAMESPACE!r} group."
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportError(f"entry point {name!r} does not name a kvbridge Transport: {cls!r}")
    cls.check_available()
    return cls


def load_transport(name: str, **options: Any) -> Transport:
    """Instantiate the transport installed under ``name`` with keyword ``options``."""
    return load_transport_class(name)(**options)
