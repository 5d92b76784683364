"""Typed messages of the mesh, and the one place that encodes/decodes them.

Every message is a dataclass registered with ``@message``. Fields typed as
``torch.Tensor`` / ``numpy.ndarray`` (optionally ``| None``) travel as raw
tensor frames; every other field goes into the msgpack header and is checked
against its type hint on decode, so a handler only ever sees a well-typed
message. Other packages add their own messages with the same decorator;
the registry maps the class name (the wire ``type``) to the class.

``Envelope`` carries what belongs to the link rather than to the message:
the call id that matches a reply to its question (``call_id``, a ``CallId``; 0 = one-way,
no reply expected; the wire key is still ``request_id``, as every member since 0.1 reads
it), the sender's sequence number and node id. ``StageForward.request_id`` (a
``RequestId``) is a different thing: it names a *generation* request, a string chosen by
the client API.

Fields marked with ``activation()`` are float32 hidden states that may be sent
at reduced precision (``encode(..., activation_dtype="float16")``); see
``transport.wire.REDUCED_PRECISION_ERROR`` for the error that adds.

Fields marked with ``flattened(part)`` hold a typed value (a frozen dataclass)
that travels as several plain header fields: the wire stays the one older peers
read, the code sees one value.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NewType, Sequence, Union, get_args, get_origin

import numpy as np
import torch

from decoding.penalties import Penalties
from decoding.sampling import SamplingParams, SamplingSpec
from partition.ids import CallId, CloudSession, NodeId, PlanVersion, RequestId, SeqKey
from transport import wire
from transport.errors import ProtocolError
from transport.wire import DEFAULT_LIMITS, Limits

__all__ = [
    "Message",
    "Envelope",
    "message",
    "activation",
    "flattened",
    "WirePart",
    "registry",
    "encode",
    "decode",
    "Hello",
    "HelloReply",
    "LinkProbe",
    "LinkProbeAck",
    "StageForward",
    "TokenResult",
    "Truncate",
    "FreeSequence",
    "ForkSequence",
    "PrefixProbe",
    "PrefixMatch",
    "ReusePrefix",
    "CacheSequence",
    "Ack",
    "ErrorReply",
    "PlanUpdate",
    "CloudVerify",
    "CloudVerdict",
    "CloudClose",
]

Message = Any  # any instance of a registered message class

_REGISTRY: dict[str, type] = {}
_SPECS: dict[type, "_ClassSpec"] = {}


@dataclass(frozen=True)
class _FieldSpec:
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
class _PartSpec:
    name: str  # the dataclass field
    part: WirePart


@dataclass(frozen=True)
class _ClassSpec:
    type_name: str
    cls: type
    fields: tuple[_FieldSpec, ...]  # as on the wire: a flattened field's parts, not the field
    by_name: dict[str, _FieldSpec]
    compact: bool = False
    extensible: bool = False
    parts: tuple[_PartSpec, ...] = ()


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


def _plain(hint: Any) -> Any:
    """A ``NewType`` id travels as its base type."""
    while isinstance(hint, NewType):
        hint = hint.__supertype__
    return hint


def _tensor_kind(hint: Any) -> str | None:
    args = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    kinds = {"torch" if a is torch.Tensor else "numpy" for a in args if a in (torch.Tensor, np.ndarray)}
    if not kinds:
        return None
    if any(a not in (torch.Tensor, np.ndarray, type(None)) for a in args):
        raise TypeError(f"tensor field hint {hint!r} may only mix torch.Tensor, numpy.ndarray and None")
    return kinds.pop() if len(kinds) == 1 else "any"


_SCALARS = (int, float, str, bool, bytes, type(None))


def _check_hint(hint: Any) -> None:
    """Refuse, at class definition time, hints the decoder cannot verify."""
    if hint is Any or hint in _SCALARS:
        return
    origin = get_origin(hint)
    if origin in (Union, types.UnionType, list, tuple, dict):
        for a in get_args(hint):
            if a is not Ellipsis:
                _check_hint(a)
        return
    if origin is Literal or hint in (list, dict, tuple):
        return
    raise TypeError(f"unsupported field type {hint!r} in a message (use plain types, list, dict, tuple)")


def message(cls: type | None = None, *, name: str | None = None, compact: bool = False,
            extensible: bool = False):
    """Register a dataclass as a wire message (its ``type`` is the class name).

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
            c = dataclass(c)
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
                    _check_hint(whint)
                    specs.append(_FieldSpec(wname, whint, None, False, False, default[wname]))
                parts.append(_PartSpec(f.name, part))
                continue
            hint = _plain(hints[f.name])
            kind = _tensor_kind(hint)
            if kind is None:
                _check_hint(hint)
            act = bool(f.metadata.get("activation"))
            if act and kind is None:
                raise TypeError(f"{type_name}.{f.name}: activation() is for tensor fields")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if compact and kind is not None:
                raise TypeError(f"{type_name}.{f.name}: a compact message cannot carry tensors")
            specs.append(_FieldSpec(f.name, hint, kind, act, required, f.default, bool(f.metadata.get("later"))))
        _REGISTRY[type_name] = c
        by_name = {s.name: s for s in specs}
        if len(by_name) != len(specs):
            raise TypeError(f"{type_name}: a flattened field's wire names clash with another field")
        _SPECS[c] = _ClassSpec(type_name, c, tuple(specs), by_name, compact, extensible, tuple(parts))
        return c

    return wrap(cls) if cls is not None else wrap


def registry() -> dict[str, type]:
    """A copy of the type-name -> class map (for docs and tests)."""
    return dict(_REGISTRY)


# ------------------------------------------------------------------ coercion

_BAD = object()


def _coerce(value: Any, hint: Any) -> Any:
    """Return ``value`` made to fit ``hint`` (lists->tuples, int->float) or _BAD."""
    if type(value) is hint and hint is not tuple:  # fast path: str, int, float, bool...
        return value
    if hint is Any:
        return value
    if hint is type(None):
        return None if value is None else _BAD
    if hint is bool:
        return value if isinstance(value, bool) else _BAD
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return _BAD
    if hint is str:
        return value if isinstance(value, str) else _BAD
    if hint is bytes:
        return value if isinstance(value, bytes) else _BAD
    if hint is list:
        return value if isinstance(value, list) else _BAD
    if hint is dict:
        return value if isinstance(value, dict) else _BAD
    if hint is tuple:
        return tuple(value) if isinstance(value, (list, tuple)) else _BAD
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        for a in args:
            out = _coerce(value, a)
            if out is not _BAD:
                return out
        return _BAD
    if origin is Literal:
        return value if value in args and not isinstance(value, (list, dict)) else _BAD
    if origin is list:
        if not isinstance(value, list):
            return _BAD
        out = [_coerce(v, args[0]) for v in value]
        return _BAD if any(v is _BAD for v in out) else out
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return _BAD
        if len(args) == 2 and args[1] is Ellipsis:
            out = [_coerce(v, args[0]) for v in value]
        elif len(args) != len(value):
            return _BAD
        else:
            out = [_coerce(v, a) for v, a in zip(value, args)]
        return _BAD if any(v is _BAD for v in out) else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            return _BAD
        kh, vh = args
        out = {}
        for k, v in value.items():
            ck, cv = _coerce(k, kh), _coerce(v, vh)
            if ck is _BAD or cv is _BAD:
                return _BAD
            out[ck] = cv
        return out
    return _BAD


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


# ------------------------------------------------------------------ envelope


@dataclass
class Envelope:
    """A message plus what the link needs to route it and match its reply."""

    message: Any
    call_id: CallId = CallId(0)  # link-level; 0 means one-way (no reply expected); wire key "request_id"
    seq: int = 0  # sender's running message counter
    sender: str = ""  # sender's node id
    unknown_fields: tuple[str, ...] = ()  # an extensible message's fields this code does not know


def encode(
    msg: Any,
    *,
    call_id: int = 0,
    seq: int = 0,
    sender: str = "",
    activation_dtype: str | None = None,
) -> list[Any]:
    """Encode one message (or an ``Envelope``) into ZeroMQ frames.

    ``activation_dtype`` ("float16"/"bfloat16") sends float32 tensors in
    ``activation()`` fields at that precision; the receiver restores float32.
    """
    if isinstance(msg, Envelope):
        call_id, seq, sender, msg = msg.call_id, msg.seq, msg.sender, msg.message
    spec = _SPECS.get(type(msg))
    if spec is None:
        raise ProtocolError(f"{type(msg).__name__} is not a registered message type")
    if spec.compact:
        values = [getattr(msg, f.name) for f in spec.fields]
        while values and not spec.fields[len(values) - 1].required \
                and values[-1] == spec.fields[len(values) - 1].default:
            values.pop()
        return wire.encode_compact(spec.type_name, values, call_id=call_id)
    fields: dict[str, Any] = {}
    tensors: list[tuple[str, Any, str | None]] = []
    flat = _flat_values(msg, spec)
    for f in spec.fields:
        value = flat[f.name] if f.name in flat else getattr(msg, f.name)
        if f.tensor_kind is None:
            if (spec.extensible or f.later) and not f.required and _same(value, f.default):
                continue
            fields[f.name] = value
        elif value is not None:
            tensors.append((f.name, value, activation_dtype if f.activation else None))
    return wire.encode_frames(
        spec.type_name, fields, tensors, call_id=call_id, seq=seq, sender=sender
    )


def _flat_values(msg: Any, spec: _ClassSpec) -> dict[str, Any]:
    """The wire values of ``msg``'s flattened fields, by wire name."""
    out: dict[str, Any] = {}
    for p in spec.parts:
        out.update(p.part.to_wire(getattr(msg, p.name)))
    return out


def header_values(msg: Any) -> dict[str, Any]:
    """``msg``'s header fields as they travel (a flattened field as its parts), by wire name."""
    spec = _SPECS[type(msg)]
    flat = _flat_values(msg, spec)
    return {f.name: flat[f.name] if f.name in flat else getattr(msg, f.name)
            for f in spec.fields if f.tensor_kind is None}


def decode(frames: Sequence[Any], *, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Decode frames into an ``Envelope``; anything malformed -> ``ProtocolError``.

    Never raises anything else for bad input: the receiving loop relies on it
    to answer with an error reply and carry on.
    """
    header = wire.decode_header(frames, limits)
    rid = header.call_id

    cls = _REGISTRY.get(header.type)
    if cls is None:
        raise ProtocolError(f"unknown message type {header.type!r}", call_id=rid)
    spec = _SPECS[cls]
    kwargs: dict[str, Any] = {}
    if isinstance(header.fields, list):
        if not spec.compact:
            raise ProtocolError(f"{header.type} does not travel in compact form", call_id=rid)
        if len(header.fields) > len(spec.fields):
            raise ProtocolError(f"{header.type} has {len(spec.fields)} fields, got {len(header.fields)}",
                                call_id=rid)
        header.fields = {f.name: v for f, v in zip(spec.fields, header.fields)}
    elif spec.compact:
        raise ProtocolError(f"{header.type} travels in compact form only", call_id=rid)
    unknown: list[str] = []
    for name, value in header.fields.items():
        f = spec.by_name.get(name)
        if f is None and spec.extensible:
            unknown.append(str(name))
            continue
        if f is None:
            raise ProtocolError(f"{header.type} has no field {name!r}", call_id=rid)
        if f.tensor_kind is not None:
            if value is not None:
                raise ProtocolError(f"{header.type}.{name} is a tensor field but came in the header", call_id=rid)
            kwargs[name] = None
            continue
        out = _coerce(value, f.hint)
        if out is _BAD:
            raise ProtocolError(
                f"{header.type}.{name} should be {_hint_name(f.hint)}, got {type(value).__name__}",
                call_id=rid,
            )
        kwargs[name] = out
    for ts in header.tensors:
        f = spec.by_name.get(ts.name)
        if f is None and spec.extensible:
            unknown.append(str(ts.name))
            continue
        if f is None or f.tensor_kind is None:
            raise ProtocolError(f"{header.type} has no tensor field {ts.name!r}", call_id=rid)
        kind = None if f.tensor_kind == "any" else f.tensor_kind
        try:
            kwargs[ts.name] = wire.decode_tensor(frames[ts.frame], ts, kind)
        except ProtocolError as e:
            raise ProtocolError(f"{header.type}.{e}", call_id=rid) from None
    missing = [f.name for f in spec.fields if f.required and f.name not in kwargs]
    if missing:
        raise ProtocolError(f"{header.type} is missing field(s) {', '.join(missing)}", call_id=rid)
    try:
        for p in spec.parts:
            wire_values = {name: kwargs.pop(name, spec.by_name[name].default) for name in p.part.fields}
            kwargs[p.name] = p.part.from_wire(wire_values)
        msg = cls(**kwargs)
    except Exception as e:  # a __post_init__ (or a flattened field) refusing the values
        raise ProtocolError(f"invalid {header.type}: {e}", call_id=rid) from None
    return Envelope(msg, rid, header.seq, header.sender, _named(unknown))


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


#: unknown field names an envelope keeps (a hostile header may name thousands)
MAX_UNKNOWN_NAMED = 16


def _named(unknown: list[str]) -> tuple[str, ...]:
    names = sorted(unknown)
    if len(names) <= MAX_UNKNOWN_NAMED:
        return tuple(names)
    return (*names[:MAX_UNKNOWN_NAMED], f"... {len(names) - MAX_UNKNOWN_NAMED} more")


# ------------------------------------------------------------------ messages
# Every message that concerns a plan carries plan_version, so a stage can
# refuse work computed against a stale partition instead of mixing layers.


@message
@dataclass
class Hello:
    """First contact: who I am and which plan I run."""

    node_id: NodeId
    plan_version: PlanVersion
    key_fingerprint: str
    address: str = ""  # where this node's StageServer listens, if anywhere


@message
@dataclass
class HelloReply:
    node_id: NodeId
    plan_version: PlanVersion
    key_fingerprint: str
    accepted: bool = True
    reason: str = ""
    exits: int = later(0)  # exit layers this stage checks (early exits; 0: none, or a stage on an older meshd)


@message(name="Heartbeat")  # its wire name since 0.1
@dataclass
class LinkProbe:
    """A round-trip probe of one control link (answered at once with ``LinkProbeAck``).

    Not the members' liveness gossip (``meshd.mesh.control.MeshHeartbeat``): it only measures
    whether, and how fast, one link answers.
    """

    node_id: NodeId
    state: str  # e.g. "idle", "serving", "draining"
    load: float  # 0..1 share of the node's compute in use
    plan_version: PlanVersion
    timestamp: float  # sender's time.time(), for liveness and clock-skew hints


@message(name="HeartbeatAck")  # its wire name since 0.1
@dataclass
class LinkProbeAck:
    node_id: NodeId
    plan_version: PlanVersion
    timestamp: float


def _sampling_to_wire(s: SamplingSpec) -> dict[str, Any]:
    p = s.params
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "seed": p.seed,
            "constraint": s.constraint, "penalties": s.penalties.to_dict() if s.penalties.active else None}


def _sampling_from_wire(d: dict[str, Any]) -> SamplingSpec:
    params = SamplingParams(d["temperature"], d["top_k"], d["top_p"], d["seed"])
    return SamplingSpec(params, Penalties.from_dict(d["penalties"]) if d["penalties"] else Penalties(),
                        d["constraint"])


#: A :class:`decoding.sampling.SamplingSpec` as StageForward has carried it since 0.2: flat
#: fields, the penalties as a dict (None when inactive). Members on 0.2 read and send exactly these.
SAMPLING_WIRE = WirePart(
    {"temperature": float, "top_k": int, "top_p": float, "seed": int | None,
     "constraint": dict | None, "penalties": dict | None},
    _sampling_to_wire, _sampling_from_wire)


@message
@dataclass
class StageForward:
    """One chunk of work for the next pipeline stage.

    ``hidden`` carries activations ([tokens, hidden] float32, may travel as
    float16/bfloat16); the first stage gets ``token_ids`` instead. The final
    stage sends its ``TokenResult`` to ``reply_to``.

    ``seq_id`` is the home-wide sequence key (coordinator node id + its own
    counter), never a bare per-coordinator number: two daemons coordinating at
    once must never touch each other's caches. ``sampling`` is the request's one
    :class:`~decoding.sampling.SamplingSpec` (flat fields on the wire, see
    ``SAMPLING_WIRE``); its shaping (penalties, grammar) rides only on a
    sequence's last prompt chunk, with ``prompt_tail`` and ``history``: the last
    stage builds the sequence's selector from that one and keeps it.
    ``sample_step`` is how many tokens this request has already sampled, so a
    request replayed on a new plan continues the same seeded random stream.

    Speculative decoding adds a *verify round*: ``token_ids`` (which then
    travel to every stage) are the root — the last committed token — and the
    drafted candidates, ``tree_parents`` their token tree (parent index per
    node, -1 for the root; absent = a chain). Every stage writes their KV at
    [position_offset, position_offset + m); the last stage decides acceptance.
    The previous round's outcome rides in the header of the next:
    ``commit_start``/``commit_keep`` tell each stage which of the nodes it wrote
    at ``commit_start`` to keep (in order) before it runs this one, so the
    rollback reaches every stage before its next forward without any extra
    message. ``medusa_paths`` asks the last stage for that many Medusa tree
    paths from the last accepted token; ``typical`` opts into Medusa's lossy
    typical acceptance.
    """

    request_id: RequestId
    plan_version: PlanVersion
    seq_id: SeqKey
    position_offset: int
    chunk_index: int = 0
    hidden: torch.Tensor | None = activation()
    token_ids: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    reply_to: str = ""
    is_last_chunk: bool = True
    capacity: int = 0  # KV positions the whole request may need (prompt + max tokens)
    sampling: SamplingSpec = flattened(SAMPLING_WIRE, default_factory=SamplingSpec)
    sample_step: int = 0
    return_topk: int = 0
    verify: bool = False
    tree_parents: list[int] | None = None
    commit_start: int = -1
    commit_keep: list[int] | None = None
    medusa_paths: int = 0
    typical: bool = False
    # With a shaped ``sampling`` (a sequence's last prompt chunk): the prompt's tail the
    # penalties look back into, and the tokens generated so far (a replay rebuilds that state).
    prompt_tail: list[int] | None = None
    history: list[int] | None = None
    # Edge drafting for a cloud verifier: the last stage also reports the final layer's
    # head-averaged attention of this step's row on the sequence's last ``attention_tail``
    # positions (TokenResult.attention), from which the home judges a chunk's importance.
    attention_tail: int = 0
    # Early exits (Synera): a decode step's token may leave the model at an exit layer whose top-2
    # margin clears this threshold (0: off, the model's full depth always).
    exit_threshold: float = later(0.0)


@message
@dataclass
class TokenResult:
    """The last stage's answer: the sampled token, or for a verify round every token it committed
    (accepted candidates, then its own next token), the accepted node ``path`` (root first) and,
    when asked, the Medusa ``proposals`` for the next round (one token sequence per tree path);
    ``note`` says why proposals are missing (e.g. the heads could not be loaded)."""

    request_id: RequestId
    plan_version: PlanVersion
    seq_id: SeqKey
    token_ids: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_probs: torch.Tensor | None = None
    logprobs: list[float] | None = None
    chunk_index: int = 0
    path: list[int] | None = None
    proposals: list[list[int]] | None = None
    proposal_values: list[float] | None = None  # each proposal's estimated chance of acceptance
    note: str = ""
    finished: bool = False  # the grammar is complete: the answer ends after these tokens
    attention: list[float] | None = None  # see StageForward.attention_tail
    exit_layer: int = later(0)  # the token left the model after this many layers (0: it went through all)


@message
@dataclass
class Truncate:
    """Cut a sequence's KV cache back to ``new_length`` (rejected drafts)."""

    plan_version: PlanVersion
    seq_id: SeqKey
    new_length: int


@message
@dataclass
class FreeSequence:
    """Release a sequence's KV cache; the stage also remembers the key (a tombstone)
    so prompt chunks still queued upstream cannot re-create it after the free."""

    plan_version: PlanVersion
    seq_id: SeqKey


@message
@dataclass
class ForkSequence:
    """Start ``seq_id`` sharing the first ``prefix_length`` KV entries of ``parent_id``."""

    plan_version: PlanVersion
    seq_id: SeqKey
    parent_id: SeqKey
    prefix_length: int


@message
@dataclass
class PrefixProbe:
    """How many leading ``token_ids`` does this stage hold the KV of (a finished or running request's)?
    Answered with ``PrefixMatch`` at once (it overtakes queued work, like a free)."""

    plan_version: PlanVersion
    token_ids: torch.Tensor


@message
@dataclass
class PrefixMatch:
    plan_version: PlanVersion
    length: int


@message
@dataclass
class ReusePrefix:
    """Start ``seq_id`` on the KV this stage holds for ``prefix_ids`` (forked, not copied), then pass it
    on; a stage that no longer holds all of it answers ``prefix_miss`` and the request is prefilled in
    full. Travels down the chain ahead of the sequence's first chunk, as a fork does."""

    request_id: RequestId
    plan_version: PlanVersion
    seq_id: SeqKey
    prefix_ids: torch.Tensor
    capacity: int = 0  # KV positions the whole request may need (its prefix included)
    reply_to: str = ""


@message
@dataclass
class CacheSequence:
    """The request of ``seq_id`` ended: keep what the sequence holds as a cached prefix (the stage
    keeps only verified positions, within its cache's share of the KV budget) instead of freeing it.
    Tombstones the key like ``FreeSequence``."""

    plan_version: PlanVersion
    seq_id: SeqKey


@message
@dataclass
class Ack:
    """Generic success reply for control messages that return nothing."""

    plan_version: PlanVersion = 0
    detail: str = ""


@message(extensible=True)
@dataclass
class ErrorReply:
    """The receiver could not handle a message; the client raises ``RemoteError``.

    ``code``: "protocol" (malformed message), "handler" (the handler raised),
    "unknown_type" (no handler for that message), "stale_plan", ...

    ``node``: the node that failed — the stage reporting, or the next stage it
    could not reach — so a coordinator knows whom to suspect without reading
    ``message``. Members on 0.2 neither send it (it decodes to "") nor accept
    it (their ErrorReply is strict): a sender sets it only for peers that do.
    Extensible, and fields at their default stay off the wire, so a reply
    without a node is the one 0.2 sends.
    """

    code: str
    message: str
    request_id: RequestId = RequestId("")  # the generation request concerned, if any
    node: str = ""  # the node that failed ("": not said)
    seq_id: str = ""  # the sequence concerned ("": not said): a request's earlier sequence is not its current one


@message
@dataclass
class PlanUpdate:
    """A new partition plan: ``assignment`` maps node id -> its stage row.

    ``partition.plan.Plan.to_assignment`` writes it and ``from_assignment`` reads it:
    the half-open layer range as ``layers_v2: [start, stop]`` beside ``first``/``last``
    (``last`` exclusive: what members on 0.1 and 0.2 read), the plan-wide fields in every
    row, and the leader's cut table (compact) in the first stage's row only. New keys go
    inside rows, never beside them: this message is strict, and older members refuse
    fields they do not know.
    """

    plan_version: PlanVersion
    assignment: dict[str, Any]


# ------------------------------------------------------------------ the cloud verifier's link
# A home's uplink may be a few Mbit/s with 100 ms of latency: these travel in the
# compact positional form (``message(compact=True)``), a greedy round in ~40 bytes.


@message(compact=True)
@dataclass
class CloudVerify:
    """Verify a home's drafted chunk on the verifier's bigger model.

    ``session`` is the home's number for one answer (the verifier keys it by the
    home's public key as well, so homes never see each other's). ``start``: the
    positions the home believes the verifier holds for it. ``tokens`` (uint32
    little-endian): the committed tokens from ``start`` on that the verifier has not
    seen — at least the root, the last committed token — then the ``drafts``.
    ``q`` (sampled drafts only): per draft, the drafter's distribution on the
    sampler's support as (uint32 id, float32 prob) pairs; absent for greedy requests,
    and for drafts sent as plain candidates (the verifier then samples its own token
    and accepts a draft that matches it — lossless too, for any drafter).
    ``open`` starts (or restarts after an eviction) the session: its sampling as
    ``SamplingParams.to_dict()`` (temperature, top_k, top_p, seed), ``draws`` already
    spent and ``capacity`` positions.
    """

    session: CloudSession
    start: int
    tokens: bytes
    drafts: int
    q: list[bytes] | None = None
    open: dict | None = None


@message(compact=True)
@dataclass
class CloudVerdict:
    """The verifier's answer: ``accepted`` drafts, then its own ``token`` (not yet in its cache);
    ``draws`` is how many uniform draws the session's random stream has spent (a resent
    session continues it)."""

    session: CloudSession
    accepted: int
    token: int
    draws: int = 0


@message(compact=True)
@dataclass
class CloudClose:
    """The answer is done (or abandoned): free the session's cache now."""

    session: CloudSession


@message(compact=True)
@dataclass
class CloudMembers:
    """An admitted home member vouches for its home's other members' public keys (z85).

    A device that joins the home after it paired with the verifier was not in the
    pairing's key list; any member the verifier already admits sends the home's
    current keys, and the verifier admits them under the same home (bounded per
    home). The reply is an ``Ack`` whose detail counts the keys admitted."""

    keys: list[str] = field(default_factory=list)
