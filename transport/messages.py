"""The link's envelope and codec, and the messages every link speaks.

``encode``/``decode`` turn any registered message (``transport.registry``) into
ZeroMQ frames and back (``transport.wire``, ``transport.wire_decode``); a decoded
header field is checked against its hint (``transport.hints``), so a handler only
ever sees a well-typed message, and anything malformed is a ``ProtocolError``.

``Envelope`` carries what belongs to the link rather than to the message:
the call id that matches a reply to its question (``call_id``, a ``CallId``; 0 = one-way,
no reply expected; the wire key is still ``request_id``, as every member since 0.1 reads
it), the sender's sequence number and node id. ``StageForward.request_id`` (a
``RequestId``) is a different thing: it names a *generation* request, a string chosen by
the client API.

The messages here are the link's own: hello, probes, acks, error replies and plan
updates. The stage protocol's are ``transport.stage_messages``, the cloud verifier's
``transport.cloud_messages``; the control plane's and model sharing's live with them
(``meshd.mesh.control``, ``meshd.share.messages``): those are decoded where their
handlers imported them. Transport's own three modules are always registered together (see the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partition.ids import CallId, NodeId, PlanVersion, RequestId
from transport.errors import ProtocolError
from transport.hints import BAD, coerce, hint_name
from transport.registry import ClassSpec, class_named, later, message, spec_of
from transport.wire import DEFAULT_LIMITS, Limits, encode_compact, encode_frames
from transport.wire_decode import decode_header, decode_tensor

__all__ = [
    "Envelope",
    "encode",
    "decode",
    "header_values",
    "Hello",
    "HelloReply",
    "LinkProbe",
    "LinkProbeAck",
    "Ack",
    "ErrorReply",
    "PlanUpdate",
]


@dataclass(frozen=True)
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
    spec = spec_of(type(msg))
    if spec is None:
        raise ProtocolError(f"{type(msg).__name__} is not a registered message type")
    if spec.compact:
        values = [getattr(msg, f.name) for f in spec.fields]
        while values and not spec.fields[len(values) - 1].required \
                and values[-1] == spec.fields[len(values) - 1].default:
            values.pop()
        return encode_compact(spec.type_name, values, call_id=call_id)
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
    return encode_frames(
        spec.type_name, fields, tensors, call_id=call_id, seq=seq, sender=sender
    )


def _flat_values(msg: Any, spec: ClassSpec) -> dict[str, Any]:
    """The wire values of ``msg``'s flattened fields, by wire name."""
    out: dict[str, Any] = {}
    for p in spec.parts:
        out.update(p.part.to_wire(getattr(msg, p.name)))
    return out


def header_values(msg: Any) -> dict[str, Any]:
    """``msg``'s header fields as they travel (a flattened field as its parts), by wire name."""
    spec = spec_of(type(msg))
    flat = _flat_values(msg, spec)
    return {f.name: flat[f.name] if f.name in flat else getattr(msg, f.name)
            for f in spec.fields if f.tensor_kind is None}


def decode(frames: Sequence[Any], *, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Decode frames into an ``Envelope``; anything malformed -> ``ProtocolError``.

    Never raises anything else for bad input: the receiving loop relies on it
    to answer with an error reply and carry on.
    """
    header = decode_header(frames, limits)
    rid = header.call_id

    cls = class_named(header.type)
    if cls is None:
        raise ProtocolError(f"unknown message type {header.type!r}", call_id=rid)
    spec = spec_of(cls)
    kwargs: dict[str, Any] = {}
    fields = header.fields
    if isinstance(fields, list):
        if not spec.compact:
            raise ProtocolError(f"{header.type} does not travel in compact form", call_id=rid)
        if len(fields) > len(spec.fields):
            raise ProtocolError(f"{header.type} has {len(spec.fields)} fields, got {len(fields)}",
                                call_id=rid)
        fields = {f.name: v for f, v in zip(spec.fields, fields)}
    elif spec.compact:
        raise ProtocolError(f"{header.type} travels in compact form only", call_id=rid)
    unknown: list[str] = []
    for name, value in fields.items():
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
        out = coerce(value, f.hint)
        if out is BAD:
            raise ProtocolError(
                f"{header.type}.{name} should be {hint_name(f.hint)}, got {type(value).__name__}",
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
            kwargs[ts.name] = decode_tensor(frames[ts.frame], ts, kind)
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


# ------------------------------------------------------------------ the link's messages
# Every message that concerns a plan carries plan_version, so a stage can
# refuse work computed against a stale partition instead of mixing layers.


@message
@dataclass(frozen=True)
class Hello:
    """First contact: who I am and which plan I run."""

    node_id: NodeId
    plan_version: PlanVersion
    key_fingerprint: str
    address: str = ""  # where this node's StageServer listens, if anywhere


@message
@dataclass(frozen=True)
class HelloReply:
    node_id: NodeId
    plan_version: PlanVersion
    key_fingerprint: str
    accepted: bool = True
    reason: str = ""
    exits: int = later(0)  # exit layers this stage checks (early exits; 0: none, or a stage on an older meshd)


@message(name="Heartbeat")  # its wire name since 0.1
@dataclass(frozen=True)
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
@dataclass(frozen=True)
class LinkProbeAck:
    node_id: NodeId
    plan_version: PlanVersion
    timestamp: float


@message
@dataclass(frozen=True)
class Ack:
    """Generic success reply for control messages that return nothing."""

    plan_version: PlanVersion = 0
    detail: str = ""


@message(extensible=True)
@dataclass(frozen=True)
class ErrorReply:
    """The receiver could not handle a message; the client raises ``RemoteError``.

    ``code``: "protocol" (malformed message), "handler" (the handler raised),
    "unknown_type" (no handler for that message), "stale_plan", ...

    ``node``: the node that failed — the stage reporting, or the next stage it
    could not reach — so a coordinator knows whom to suspect without reading
    ``message``. Releases before it neither send it (it decodes to "") nor
    accept it (their ErrorReply is strict): a sender sets it only for peers
    that say they decode it (meshd: ``error_node`` in their heartbeats'
    capability set). Extensible, and fields at their default stay off the
    wire, so a reply without a node is the one an older release sends.
    """

    code: str
    message: str
    request_id: RequestId = RequestId("")  # the generation request concerned, if any
    node: str = ""  # the node that failed ("": not said)
    seq_id: str = ""  # the sequence concerned ("": not said): a request's earlier sequence is not its current one


@message
@dataclass(frozen=True)
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


# Every transport message is known wherever a link decodes: the stage protocol and the cloud
# verifier's register themselves when imported, and a process that never used them must still
# answer an unknown peer's message with "unknown type" rather than a protocol error.
from transport import cloud_messages as _cloud_protocol, stage_messages as _stage_protocol  # noqa: E402

TRANSPORT_PROTOCOLS = (_stage_protocol, _cloud_protocol)
