"""Transports by name: installed ones and ones registered in this process.

Installed transports are entry points of the group ``kvbridge.transports``; stevedore's managers
load them (``NamedExtensionManager``, its ``on_load_failure_callback``). Which entry points there
are is read from the distributions' metadata (``importlib.metadata``) on every lookup and handed
to the manager (``_PluginManager.list_entry_points``), not from stevedore's entry-point cache:
that cache keeps, for the life of the process, what it read first (a transport installed since
would stay unseen), and the entry points it returns no longer say which distribution declares
them (a conflict could not name both). ``tests/core/test_registry.py`` shows both against
stevedore itself.

Reading metadata imports nothing; ``load_transport(name)`` imports only the plugin of ``name``,
so a broken or heavy plugin under another name is never imported (``available_transports``
imports them all, to say which are usable).

A name belongs to one distribution: when two distributions declare it, loading it is refused
with both named (``TransportConflictError``), before either plugin is imported. A distribution
found twice on ``sys.path`` (an editable install and its source tree, say) counts once: the
first found, as ``importlib.metadata.entry_points`` does.

Options are checked against the class before it is built (``kvbridge.core.contract``): a name it
does not take or a value of the wrong type raises ``TransportOptionError`` with the transport's
options. ``check_options(name, options)`` checks them without starting the engine (a
configuration read at start, long before the transport is built).

``register_transport(name, cls)`` adds a transport class in this process only (a test's
in-process transport, a wrapper that injects faults); it shadows an installed or registered name
only with ``replace=True``. ``unregister_transport(name)`` takes it back.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, distributions
from typing import Any

from stevedore import ExtensionManager, NamedExtensionManager

from kvbridge.core.errors import (
    TransportConflictError,
    TransportError,
    TransportNotFoundError,
    TransportUnavailableError,
)
from kvbridge.core.transport import Transport
from kvbridge.core.transport_options import check_transport_options

NAMESPACE = "kvbridge.transports"

__all__ = [
    "NAMESPACE",
    "TransportInfo",
    "available_transports",
    "check_options",
    "load_transport",
    "load_transport_class",
    "register_transport",
    "transport_names",
    "unregister_transport",
]

#: name -> class, registered in this process (``register_transport``); looked up first
_registered: dict[str, type[Transport]] = {}
_registered_lock = threading.Lock()


@dataclass(frozen=True)
class TransportInfo:
    """One installed transport as ``kvbridge transports`` shows it."""

    name: str
    package: str
    usable: bool
    reason: str = ""


@dataclass(frozen=True)
class _Installed:
    """An entry point of the group and the distribution that declares it."""

    entry_point: EntryPoint
    package: str  # "name version"
    dist_key: str  # normalized distribution name


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, list[_Installed]]:
    """Every installed entry point of the group by name, each distribution counted once."""
    found: dict[str, list[_Installed]] = {}
    seen: set[str] = set()
    for dist in distributions():  # in sys.path order
        eps = dist.entry_points.select(group=NAMESPACE)
        if not eps:
            continue
        dist_name = dist.metadata["Name"] or "?"
        key = _normalize(dist_name)
        if key in seen:  # the same distribution again, later on sys.path: the first one counts
            continue
        seen.add(key)
        for ep in eps:
            entries = found.setdefault(ep.name, [])
            if all(e.dist_key != key for e in entries):
                entries.append(_Installed(ep, f"{dist_name} {dist.version}", key))
    return found


def _conflict_message(name: str, entries: list[_Installed]) -> str:
    who = " and ".join(f"{e.package} ({e.entry_point.value})" for e in entries)
    return (
        f"transport name {name!r} is declared by {len(entries)} distributions, {who}; uninstall "
        f"all but one, or register the one to use with "
        f"kvbridge.register_transport({name!r}, cls, replace=True)"
    )


def _describe_class(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _PluginManager(NamedExtensionManager[Any]):
    """stevedore's manager of one installed plugin, the entry point kvbridge found for it.

    ``list_entry_points`` (stevedore's public hook for where entry points come from) answers
    that entry, read fresh from the metadata (see the module docstring), instead of stevedore's
    cache; the manager loads it by its name. A plugin that fails to import is kept in
    ``failure``, never raised or logged by stevedore.
    """

    def __init__(self, entry: _Installed) -> None:
        self._listed = [entry.entry_point]
        self.failure: BaseException | None = None
        super().__init__(
            NAMESPACE,
            [entry.entry_point.name],
            on_load_failure_callback=self._failed,
            on_missing_entrypoints_callback=None,
        )

    def list_entry_points(self) -> list[EntryPoint]:
        return self._listed

    def _failed(self, manager: ExtensionManager[Any], ep: EntryPoint, err: BaseException) -> None:
        self.failure = err


def _import_plugin(name: str, entry: _Installed) -> type[Transport]:
    """The class an entry point names, imported now; only ``name``'s plugin is imported."""
    manager = None
    try:
        manager = _PluginManager(entry)
        failure = manager.failure
    except AssertionError as err:  # stevedore lets these past its callback: still the plugin's
        failure = err
    if failure is not None or manager is None:
        raise TransportUnavailableError(
            f"transport {name!r} is installed ({entry.package}) but its plugin cannot be "
            f"imported: {type(failure).__name__}: {failure}"
        ) from failure
    cls = manager[name].plugin
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportError(
            f"entry point {name!r} of {entry.package} does not name a kvbridge Transport: {cls!r}"
        )
    return cls


def transport_names() -> list[str]:
    """Names of every installed and registered transport, sorted; imports no plugin."""
    return sorted(set(_installed()) | set(_registered))


def _known_names() -> str:
    registered = set(_registered)
    names = [f"{n} (registered)" if n in registered else n for n in transport_names()]
    return ", ".join(names) or "none"


def _unavailable_reason(cls: type[Transport]) -> str | None:
    try:
        cls.check_available()
    except TransportUnavailableError as err:
        return str(err)
    return None


def available_transports() -> list[TransportInfo]:
    """Every installed or registered transport, usable or not, sorted by name.

    Imports every installed plugin (to ask each whether its engine loads); one that cannot be
    imported is reported, not raised.
    """
    installed = _installed()
    registered = dict(_registered)
    infos = []
    for name in sorted(set(installed) | set(registered)):
        if name in registered:
            cls = registered[name]
            package = f"registered in this process ({_describe_class(cls)})"
            reason = _unavailable_reason(cls)
            infos.append(TransportInfo(name, package, reason is None, reason or ""))
            continue
        entries = installed[name]
        package = ", ".join(e.package for e in entries)
        if len(entries) > 1:
            infos.append(TransportInfo(name, package, False, _conflict_message(name, entries)))
            continue
        try:
            cls = _import_plugin(name, entries[0])
        except TransportUnavailableError as err:
            reason = f"cannot import plugin: {err.__cause__}"
            infos.append(TransportInfo(name, package, False, reason))
            continue
        except TransportError as err:
            infos.append(TransportInfo(name, package, False, str(err)))
            continue
        reason = _unavailable_reason(cls)
        infos.append(TransportInfo(name, package, reason is None, reason or ""))
    return infos


def load_transport_class(name: str) -> type[Transport]:
    """The transport class registered or installed under ``name``, checked for a usable engine.

    Imports only that transport's plugin.
    """
    cls = _find_class(name)
    cls.check_available()
    return cls


def _find_class(name: str) -> type[Transport]:
    """The class registered or installed under ``name``, its plugin imported, its engine not
    probed; ``TransportError`` (not found, two of the name, an import that failed) if none."""
    cls = _registered.get(name)
    if cls is not None:
        return cls
    entries = _installed().get(name)
    if not entries:
        raise TransportNotFoundError(
            f"no transport named {name!r}; installed or registered transports: "
            f"{_known_names()}. A transport is a package that declares an entry point in "
            f"the {NAMESPACE!r} group, or a class given to kvbridge.register_transport"
        )
    if len(entries) > 1:
        raise TransportConflictError(_conflict_message(name, entries))
    return _import_plugin(name, entries[0])


def load_transport(name: str, **options: Any) -> Transport:
    """Instantiate the transport registered or installed under ``name`` with keyword ``options``.

    An option the transport does not take, or a value of the wrong type, raises
    ``TransportOptionError`` naming the transport's options (``check_options``).
    """
    return load_transport_class(name)(**options)


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Check ``options`` against the transport ``name`` without starting it (its engine need not
    load): ``TransportOptionError`` (one line: the option, a close match, the transport's
    options) for an option it does not take or a value of the wrong type.

    Checks nothing when ``name``'s class cannot be found or imported: building the transport
    later says why.
    """
    try:
        cls = _find_class(name)
    except TransportError:
        return
    check_transport_options(cls, options)


def register_transport(name: str, cls: type[Transport], *, replace: bool = False) -> None:
    """Make ``load_transport(name)`` build ``cls``, in this process only.

    ``cls`` is a ``Transport`` subclass. A name that is installed or registered already is
    refused (``TransportConflictError``) unless ``replace`` is True: the registered class then
    shadows the installed one (or replaces the registered one) until ``unregister_transport``.
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a transport name is a non-empty string without outer spaces: {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"register_transport({name!r}, ...) needs a Transport subclass: {cls!r}")
    with _registered_lock:
        if not replace:
            old = _registered.get(name)
            if old is not None:
                raise TransportConflictError(
                    f"transport {name!r} is registered already ({_describe_class(old)}); pass "
                    "replace=True to replace it, or unregister_transport it first"
                )
            entries = _installed().get(name)
            if entries:
                packages = " and ".join(e.package for e in entries)
                raise TransportConflictError(
                    f"transport {name!r} is installed ({packages}); pass replace=True to shadow "
                    "it in this process with the registered class"
                )
        _registered[name] = cls


def unregister_transport(name: str) -> None:
    """Forget a class ``register_transport`` registered; an installed one of the name returns.

    Raises ``TransportNotFoundError`` when nothing is registered under ``name`` (installed
    transports cannot be unregistered).
    """
    with _registered_lock:
        if _registered.pop(name, None) is not None:
            return
        registered = ", ".join(sorted(_registered)) or "none"
    raise TransportNotFoundError(
        f"no transport is registered under {name!r} (registered: {registered}); "
        "unregister_transport takes back only what register_transport registered"
    )
