"""The message registry: a frozen dataclass becomes a wire message with ``@message``.

Every message is a frozen dataclass registered here; its ``type`` on the wire is the
class name (or ``name=``). Fields typed as ``torch.Tensor`` / ``numpy.ndarray``
(optionally ``| None``) travel as raw tensor frames; every other field goes into the
msgpack header and is checked against its type hint on decode (``transport.hints``).
Field markers say more: ``activation()`` (a float32 hidden state that may travel at
reduced precision), ``later(default)`` (a field added after the message shipped: off
the wire at its default) and ``flattened(part)`` (a typed value that travels as several
plain header fields, see :class:`WirePart`). Other packages register their own messages
the same way; the codec (``transport.messages.encode``/``decode``) reads the specs kept
here.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transport.hints import check_hint, plain, tensor_kind

__all__ = ["ClassSpec", "FieldSpec", "PartSpec", "WirePart", "activation", "class_named", "flattened", "later",
           "message", "registry", "spec_of"]

_REGISTRY: dict[str, type] = {}
_SPECS: dict[type, "ClassSpec"] = {}


@dataclass(frozen=True)
class FieldSpec:
    name: str
    hint: Any
    tensor_kind: str | None  # "torch", "numpy", "any" or None (header field)
    activation: bool
    required: bool
    default: Any  # dataclasses.MISSING for required fields and factories
    later: bool = False  # added after the message shipped: off the wire at its default (see :func:`later`)


@dataclass(frozen=True)
class WirePart:
    """How one typed field travels as plain header fields.

    ``fields``: wire name -> plain type hint (checked on decode like any field);
    ``to_wire`` gives every one of them, ``from_wire`` gets every one of them
    (absent ones at the default's wire value) and raises ``ValueError`` (or the
    type's own error) for values it refuses.
    """

    fields: dict[str, Any]
    to_wire: Callable[[Any], dict[str, Any]]
    from_wire: Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class PartSpec:
    name: str  # the dataclass field
    part: WirePart


@dataclass(frozen=True)
class ClassSpec:
    type_name: str
    cls: type
    fields: tuple[FieldSpec, ...]  # as on the wire: a flattened field's parts, not the field
    by_name: dict[str, FieldSpec]
    compact: bool = False
    extensible: bool = False
    parts: tuple[PartSpec, ...] = ()


def activation(**kwargs: Any) -> Any:
    """A float32 tensor field that may travel at reduced precision."""
    kwargs.setdefault("default", None)
    return field(metadata={"activation": True}, **kwargs)


def later(default: Any) -> Any:
    """A header field added after the message shipped: it travels only when it differs from ``default``,
    so a member running an older meshd still reads every message that does not use it."""
    return field(default=default, metadata={"later": True})


def flattened(part: WirePart, **kwargs: Any) -> Any:
    """A typed field that travels as ``part``'s plain header fields (see :class:`WirePart`)."""
    return field(metadata={"wire_part": part}, **kwargs)


def message(cls: type | None = None, *, name: str | None = None, compact: bool = False,
            extensible: bool = False):
    """Register a frozen dataclass as a wire message (its ``type`` is the class name).

    A message is a value: once built (or decoded) nobody changes it, so a handler
    can pass it on or keep it without a copy; build a changed one with
    ``dataclasses.replace``. A class that is not a dataclass yet is made a frozen
    one; a mutable dataclass is refused.

    ``compact=True``: the message travels as one positional array frame
    (``transport.wire.encode_compact``) — for small messages on slow links. It
    may not have tensor fields.

    ``extensible=True``: header fields this code does not know are left out and
    named in ``Envelope.unknown_fields`` instead of failing the message. Only for
    messages a newer peer may extend with fields an older one can do without
    (liveness gossip): refusing them would make a device upgraded first look dead
    to the rest of its home. Known fields are type-checked as always. Fields at
    their default are not sent, so a field a peer predates reaches it only when
    the sender sets it.
    """

    def wrap(c: type) -> type:
        if compact and extensible:
            raise TypeError("a compact message is positional: it cannot be extensible")
        if not dataclasses.is_dataclass(c):
            c = dataclass(frozen=True)(c)
        elif not c.__dataclass_params__.frozen:
            raise TypeError(f"{c.__name__}: a message is a frozen dataclass (@dataclass(frozen=True))")
        type_name = name or c.__name__
        if type_name in _REGISTRY and _REGISTRY[type_name] is not c:
            raise TypeError(f"message type {type_name!r} is already registered")
        hints = typing.get_type_hints(c)
        specs, parts = [], []
        for f in dataclasses.fields(c):
            part = f.metadata.get("wire_part")
            if part is not None:
                if compact:
                    raise TypeError(f"{type_name}.{f.name}: a compact message cannot flatten fields")
                if f.default_factory is not dataclasses.MISSING:
                    default = part.to_wire(f.default_factory())
                elif f.default is not dataclasses.MISSING:
                    default = part.to_wire(f.default)
                else:
                    raise TypeError(f"{type_name}.{f.name}: a flattened field needs a default")
                for wname, whint in part.fields.items():
                    check_hint(whint)
                    specs.append(FieldSpec(wname, whint, None, False, False, default[wname]))
                parts.append(PartSpec(f.name, part))
                continue
            hint = plain(hints[f.name])
            kind = tensor_kind(hint)
            if kind is None:
                check_hint(hint)
            act = bool(f.metadata.get("activation"))
            if act and kind is None:
                raise TypeError(f"{type_name}.{f.name}: activation() is for tensor fields")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if compact and kind is not None:
                raise TypeError(f"{type_name}.{f.name}: a compact message cannot carry tensors")
            specs.append(FieldSpec(f.name, hint, kind, act, required, f.default, bool(f.metadata.get("later"))))
        _REGISTRY[type_name] = c
        by_name = {s.name: s for s in specs}
        if len(by_name) != len(specs):
            raise TypeError(f"{type_name}: a flattened field's wire names clash with another field")
        _SPECS[c] = ClassSpec(type_name, c, tuple(specs), by_name, compact, extensible, tuple(parts))
        return c

    return wrap(cls) if cls is not None else wrap


def registry() -> dict[str, type]:
    """A copy of the type-name -> class map (for docs and tests)."""
    return dict(_REGISTRY)


def class_named(type_name: str) -> type | None:
    """The message class a wire ``type`` names (None: no module imported here registered it)."""
    return _REGISTRY.get(type_name)


def spec_of(cls: type) -> ClassSpec | None:
    """How ``cls`` travels (None: not a registered message)."""
    return _SPECS.get(cls)
