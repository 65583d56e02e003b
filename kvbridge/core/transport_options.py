"""A transport's keyword options, read from its ``__init__`` and checked before it runs.

``transport_options(cls)`` reads what ``cls(**options)`` takes; ``check_transport_options``
refuses an unknown name or a value of the wrong plain-data type in one line; ``CheckedOptions``
is the metaclass of ``kvbridge.core.contract.TransportContract`` that checks every construction
of a transport class, so a plugin's code never sees a bad option.
"""

from __future__ import annotations

import abc
import collections.abc
import enum
import inspect
import types
import typing
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvbridge.core.errors import TransportOptionError, did_you_mean

__all__ = ["CheckedOptions", "TransportOptions", "check_transport_options", "transport_options"]


@dataclass(frozen=True)
class TransportOptions:
    """The keyword options a transport class takes (``transport_options``).

    ``types``: each option's annotation as written (``""`` when none); ``checked``: the resolved
    type of the options whose values are checked (plain data types only); ``open``: the class
    passes unnamed options on to something that cannot be inspected, so any name may be valid.
    """

    types: Mapping[str, str]
    checked: Mapping[str, Any]
    open: bool


_DATA_TYPES = (str, int, float, bool, type(None), bytes)
_DATA_ORIGINS = (
    list,
    tuple,
    dict,
    set,
    frozenset,
    collections.abc.Sequence,
    collections.abc.Mapping,
    collections.abc.Set,
)


def _is_data(hint: Any) -> bool:
    """Whether values of ``hint`` are plain data (what JSON configs give), so msgspec can check
    them; a callable, a class of the plugin's own or an unresolved name is not checked."""
    if hint is Any or hint is Ellipsis or hint in _DATA_TYPES:
        return True
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return True
    if origin in (typing.Union, types.UnionType) or origin in _DATA_ORIGINS:
        return all(_is_data(arg) for arg in typing.get_args(hint))
    return False


_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_options_of: weakref.WeakKeyDictionary[type, TransportOptions] = weakref.WeakKeyDictionary()


def transport_options(cls: type) -> TransportOptions:
    """The keyword options ``cls(**options)`` takes: its ``__init__``'s keyword parameters, and
    while an ``__init__`` takes ``**options`` its parent class's too."""
    known = _options_of.get(cls)
    if known is not None:
        return known
    names: dict[str, str] = {}
    checked: dict[str, Any] = {}
    still_open = True
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            params = list(inspect.signature(init).parameters.values())[1:]  # after self
        except (TypeError, ValueError):
            break
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # a name only imported for type checking: nothing is checked
            hints = {}
        for p in params:
            if p.kind in _KEYWORD and p.name not in names:
                names[p.name] = p.annotation if isinstance(p.annotation, str) else ""
                hint = hints.get(p.name)
                if hint is not None and _is_data(hint):
                    checked[p.name] = hint
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            still_open = False
            break
    found = TransportOptions(names, checked, still_open)
    _options_of[cls] = found
    return found


def _label(cls: type) -> str:
    name = getattr(cls, "name", None)
    return name if isinstance(name, str) and name and name != "abstract" else cls.__qualname__


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_transport_options(cls: type, options: Mapping[str, Any]) -> None:
    """Raise ``TransportOptionError`` (one line) when ``cls`` does not take an option of
    ``options`` (naming a close match and every option it takes), or a value is not of the
    option's type; ``cls``'s own checks of values and ranges run later, in its ``__init__``."""
    spec = transport_options(cls)
    label = _label(cls)
    valid = sorted(spec.types)
    unknown = [name for name in options if name not in spec.types]
    if unknown and not spec.open:
        named = ", ".join(f"{name!r}{did_you_mean(name, valid)}" for name in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise TransportOptionError(
            f"transport {label!r} has no option{plural} {named}; its options are "
            f"{', '.join(valid) or 'none'}"
        )
    for name, value in options.items():
        hint = spec.checked.get(name)
        if hint is None:
            continue
        try:
            msgspec.convert(value, type=hint, strict=True)
        except msgspec.ValidationError as err:
            expected = spec.types[name] or str(hint)
            inside = f" ({err})" if " - at `$" in str(err) else ""  # where in a list or dict
            raise TransportOptionError(
                f"transport {label!r} option {name}={_shown(value)} has type "
                f"{type(value).__name__}; expected {expected}{inside}"
            ) from None
        except (TypeError, ValueError):  # a type msgspec does not know: the plugin checks it
            continue


class CheckedOptions(abc.ABCMeta):
    """Checks the options of every construction of a transport class before its ``__init__``."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not args:  # keyword options only, as the contract says; else Python's own error
            check_transport_options(cls, kwargs)
        return super().__call__(*args, **kwargs)
