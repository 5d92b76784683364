"""The type hints of a message's header fields: refused at class definition unless checkable, enforced on decode.

A header field may be a plain type (int, float, str, bool, bytes, None), ``Any``, a
``Literal``, or a list/tuple/dict/union of those; a typed id (a ``NewType``) travels as
its base type. ``check_hint`` refuses anything else when a message class is registered,
so ``coerce`` can fit every received value to its hint (lists to tuples, ints to
floats) or say it does not fit (``BAD``): a handler only ever sees well-typed values.
Tensor fields are told apart by ``tensor_kind``.
"""

from __future__ import annotations

import types
from typing import Any, Literal, NewType, Union, get_args, get_origin

import numpy as np
import torch

__all__ = ["BAD", "SCALARS", "check_hint", "coerce", "hint_name", "plain", "tensor_kind"]


def plain(hint: Any) -> Any:
    """A ``NewType`` id travels as its base type."""
    while isinstance(hint, NewType):
        hint = hint.__supertype__
    return hint


def tensor_kind(hint: Any) -> str | None:
    args = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    kinds = {"torch" if a is torch.Tensor else "numpy" for a in args if a in (torch.Tensor, np.ndarray)}
    if not kinds:
        return None
    if any(a not in (torch.Tensor, np.ndarray, type(None)) for a in args):
        raise TypeError(f"tensor field hint {hint!r} may only mix torch.Tensor, numpy.ndarray and None")
    return kinds.pop() if len(kinds) == 1 else "any"


SCALARS = (int, float, str, bool, bytes, type(None))


def check_hint(hint: Any) -> None:
    """Refuse, at class definition time, hints the decoder cannot verify."""
    if hint is Any or hint in SCALARS:
        return
    origin = get_origin(hint)
    if origin in (Union, types.UnionType, list, tuple, dict):
        for a in get_args(hint):
            if a is not Ellipsis:
                check_hint(a)
        return
    if origin is Literal or hint in (list, dict, tuple):
        return
    raise TypeError(f"unsupported field type {hint!r} in a message (use plain types, list, dict, tuple)")


BAD = object()


def coerce(value: Any, hint: Any) -> Any:
    """Return ``value`` made to fit ``hint`` (lists->tuples, int->float) or BAD."""
    if type(value) is hint and hint is not tuple:  # fast path: str, int, float, bool...
        return value
    if hint is Any:
        return value
    if hint is type(None):
        return None if value is None else BAD
    if hint is bool:
        return value if isinstance(value, bool) else BAD
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else BAD
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return BAD
    if hint is str:
        return value if isinstance(value, str) else BAD
    if hint is bytes:
        return value if isinstance(value, bytes) else BAD
    if hint is list:
        return value if isinstance(value, list) else BAD
    if hint is dict:
        return value if isinstance(value, dict) else BAD
    if hint is tuple:
        return tuple(value) if isinstance(value, (list, tuple)) else BAD
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        for a in args:
            out = coerce(value, a)
            if out is not BAD:
                return out
        return BAD
    if origin is Literal:
        return value if value in args and not isinstance(value, (list, dict)) else BAD
    if origin is list:
        if not isinstance(value, list):
            return BAD
        out = [coerce(v, args[0]) for v in value]
        return BAD if any(v is BAD for v in out) else out
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return BAD
        if len(args) == 2 and args[1] is Ellipsis:
            out = [coerce(v, args[0]) for v in value]
        elif len(args) != len(value):
            return BAD
        else:
            out = [coerce(v, a) for v, a in zip(value, args)]
        return BAD if any(v is BAD for v in out) else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            return BAD
        kh, vh = args
        out = {}
        for k, v in value.items():
            ck, cv = coerce(k, kh), coerce(v, vh)
            if ck is BAD or cv is BAD:
                return BAD
            out[ck] = cv
        return out
    return BAD


def hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
