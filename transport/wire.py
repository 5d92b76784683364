"""The wire format: a msgpack header frame followed by raw tensor frames.

One mesh message is one ZeroMQ multipart message::

    frame 0      msgpack map  {version, type, request_id (the call id), seq, sender,
                               fields: {...}, tensors: [descriptor, ...]}
    frame 1..n   the raw bytes of each tensor, in descriptor order

A tensor descriptor is ``{name, dtype, shape, nbytes, frame, kind}`` plus
``wire_dtype`` when the payload travels in a narrower type than it is restored
to (reduced-precision activations, see ``REDUCED_PRECISION_ERROR``).

Why this shape: tensors are the bulk of the bytes, and keeping them out of the
serialiser lets us hand their memory to ZeroMQ as-is (``copy=False``) on the
way out and wrap the received frame with ``numpy.frombuffer`` on the way in, so
a hidden-state tensor is never copied by Python on either side (tensors under
``ZERO_COPY_MIN_BYTES`` are copied on send: cheaper than zero-copy there). The header is
small, self-describing and cheap to validate *before* any tensor is touched,
which is what lets a malformed or hostile message be refused with a
``ProtocolError`` instead of crashing a stage.

This module knows nothing about message classes (see ``transport.messages``);
it defines the format and its limits and turns (type name, plain fields,
tensors) into frames; ``transport.wire_decode`` turns frames back, checking
everything first. Byte order on the wire is little-endian, the native order of every
device we target (x86-64, ARM64); big-endian numpy input is converted on send.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import msgpack
import numpy as np
import torch
import zmq

from transport.errors import ProtocolError
from transport.log import get_logger

__all__ = [
    "PROTOCOL_VERSION",
    "DTYPES",
    "Limits",
    "DEFAULT_LIMITS",
    "Header",
    "TensorSpec",
    "REDUCED_PRECISION_ERROR",
    "WireStats",
    "stats",
    "encode_frames",
    "encode_compact",
]

log = get_logger("transport.wire")

PROTOCOL_VERSION = 1

# Tensors at least this large are handed to ZeroMQ without a copy. Below it a
# memcpy is cheaper than pyzmq's zero-copy bookkeeping (~7 us per frame plus a
# wake-up of its garbage-collector thread when libzmq releases the buffer);
# 64 KiB is pyzmq's own zmq.COPY_THRESHOLD. Set to 0 to never copy.
ZERO_COPY_MIN_BYTES = 64 * 1024

# Largest finite float16; larger activations would become inf on the wire.
_FLOAT16_MAX = 65504.0

REDUCED_PRECISION_ERROR = {
    # Round-to-nearest-even conversion from float32. Bounds hold for every
    # finite value in range; measured figures are in bench/RESULTS.md
    # ("Transport") and checked by tests/transport/test_transport_wire.py.
    "float16": {
        "max_rel_error": 2.0**-11,  # 4.88e-4 for |x| >= 6.1e-5 (normal range)
        "max_abs_error_subnormal": 2.0**-25,  # 2.98e-8 for |x| < 6.1e-5
        "range": _FLOAT16_MAX,  # tensors exceeding it are sent as float32
    },
    "bfloat16": {
        "max_rel_error": 2.0**-8,  # 3.91e-3, full float32 range
        "range": float(torch.finfo(torch.float32).max),
    },
}
"""Worst-case error added by sending a float32 activation as float16/bfloat16.

float16 keeps 11 significant bits, so each value is off by at most half a unit
in the last place: relative error <= 2**-11 (0.049 %). bfloat16 keeps 8
significant bits: relative error <= 2**-8 (0.39 %), but it has float32's
exponent range so nothing overflows. A float32 tensor whose magnitude exceeds
float16's range is sent as float32 instead of becoming inf.
"""


@dataclass(frozen=True)
class _DType:
    name: str
    numpy: np.dtype  # the dtype of the payload as numpy sees it
    torch: torch.dtype
    itemsize: int


# The allow-list of dtypes. bfloat16 has no numpy dtype: its 16-bit payload is
# carried as uint16 and reinterpreted by torch, bit for bit.
DTYPES: dict[str, _DType] = {
    d.name: d
    for d in (
        _DType("float32", np.dtype("<f4"), torch.float32, 4),
        _DType("float16", np.dtype("<f2"), torch.float16, 2),
        _DType("bfloat16", np.dtype("<u2"), torch.bfloat16, 2),
        _DType("float64", np.dtype("<f8"), torch.float64, 8),
        _DType("int64", np.dtype("<i8"), torch.int64, 8),
        _DType("int32", np.dtype("<i4"), torch.int32, 4),
        _DType("int16", np.dtype("<i2"), torch.int16, 2),
        _DType("int8", np.dtype("i1"), torch.int8, 1),
        _DType("uint8", np.dtype("u1"), torch.uint8, 1),
        _DType("bool", np.dtype("?"), torch.bool, 1),
    )
}
_TORCH_NAMES = {d.torch: d.name for d in DTYPES.values()}
_NUMPY_NAMES = {d.numpy.newbyteorder("="): d.name for d in DTYPES.values() if d.name != "bfloat16"}
REDUCIBLE = {"float16", "bfloat16"}
KINDS = ("torch", "numpy")


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces before it trusts a message.

    They bound the memory a single (possibly hostile) message can make us touch
    and turn absurd headers into a clear ``ProtocolError``. ``max_total_bytes``
    is also set as the socket's ZMQ_MAXMSGSIZE, so a single frame larger than
    it makes libzmq drop that connection before the bytes are buffered.
    """

    max_header_bytes: int = 64 * 1024
    max_frames: int = 64
    max_tensor_bytes: int = 512 * 1024 * 1024
    max_total_bytes: int = 1024 * 1024 * 1024
    max_ndim: int = 8


DEFAULT_LIMITS = Limits()


@dataclass
class WireStats:
    """Counters that make the copies we cannot avoid visible (tests read them)."""

    contiguous_copies: int = 0  # non-contiguous input made contiguous on send
    device_copies: int = 0  # tensors moved from an accelerator to host memory
    unaligned_copies: int = 0  # received payloads not aligned for their dtype
    reduced_precision_fallbacks: int = 0  # float16 requested but out of range

    def reset(self) -> None:
        self.__init__()


stats = WireStats()


@dataclass(frozen=True)
class TensorSpec:
    """One validated tensor descriptor from a header."""

    name: str
    dtype: str  # dtype the receiver restores
    shape: tuple[int, ...]
    nbytes: int
    frame: int
    kind: str  # "torch" or "numpy": what the sender passed
    wire_dtype: str  # dtype of the payload bytes (== dtype unless reduced)

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "frame": self.frame,
            "kind": self.kind,
        }
        if self.wire_dtype != self.dtype:
            d["wire_dtype"] = self.wire_dtype
        return d


@dataclass(frozen=True)
class Header:
    """A decoded, validated header frame (``fields`` is a list for a compact message: the class maps
    positions to names)."""

    type: str
    call_id: int = 0
    seq: int = 0
    sender: str = ""
    fields: dict[str, Any] | list[Any] = field(default_factory=dict)
    tensors: list[TensorSpec] = field(default_factory=list)
    version: int = PROTOCOL_VERSION


# --------------------------------------------------------------------- encode


def _msgpack_default(obj: Any) -> Any:
    # numpy scalars sneak into sampling params and metrics; send them as the
    # Python value they stand for rather than failing the whole message.
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot put a {type(obj).__name__} in a message header")


def _reduce_torch(t: torch.Tensor, wire: str) -> torch.Tensor | None:
    """float32 -> float16/bfloat16, or None when float16 would overflow."""
    if wire == "float16" and t.numel():
        lo, hi = torch.aminmax(t)
        if max(-float(lo), float(hi)) > _FLOAT16_MAX:
            return None
    return t.to(DTYPES[wire].torch)


def _payload(value: Any, wire_dtype: str | None) -> tuple[np.ndarray, str, str, str, tuple[int, ...]]:
    """Return (contiguous numpy payload, dtype, wire dtype, kind, shape)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            stats.device_copies += 1
            t = t.cpu()
        name = _TORCH_NAMES.get(t.dtype)
        if name is None:
            raise ProtocolError(f"dtype {t.dtype} is not allowed on the wire (allowed: {', '.join(DTYPES)})")
        wire = name
        if wire_dtype and name == "float32" and wire_dtype != name:
            reduced = _reduce_torch(t, wire_dtype)
            if reduced is None:
                stats.reduced_precision_fallbacks += 1
                log.debug("reduced_precision_fallback", reason="float16 overflow", shape=tuple(t.shape))
            else:
                t, wire = reduced, wire_dtype
        if not t.is_contiguous():
            # The one visible copy: ZeroMQ needs one flat buffer per frame.
            stats.contiguous_copies += 1
            t = t.contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.uint16) if hasattr(torch, "uint16") else t.view(torch.int16)
        return t.numpy(), name, wire, "torch", tuple(value.shape)

    if isinstance(value, np.ndarray):
        a = value
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        name = _NUMPY_NAMES.get(a.dtype.newbyteorder("="))
        if name is None:
            raise ProtocolError(f"dtype {a.dtype} is not allowed on the wire (allowed: {', '.join(DTYPES)})")
        wire = name
        if wire_dtype and name == "float32" and wire_dtype != name:
            reduced = _reduce_torch(torch.from_numpy(np.ascontiguousarray(a)), wire_dtype)
            if reduced is None:
                stats.reduced_precision_fallbacks += 1
            else:
                wire = wire_dtype
                r = reduced.view(torch.int16) if wire == "bfloat16" else reduced
                a = r.numpy()
        if not a.flags.c_contiguous:
            stats.contiguous_copies += 1
            a = np.ascontiguousarray(a)
        return a, name, wire, "numpy", tuple(value.shape)

    raise ProtocolError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def encode_frames(
    type_name: str,
    fields: dict[str, Any],
    tensors: Iterable[tuple[str, Any, str | None]] = (),
    *,
    call_id: int = 0,
    seq: int = 0,
    sender: str = "",
) -> list[Any]:
    """Build the frames of one message.

    ``tensors`` yields ``(name, tensor, wire_dtype)``; ``wire_dtype`` is None,
    or "float16"/"bfloat16" to send a float32 tensor at reduced precision.
    Tensor frames of ``ZERO_COPY_MIN_BYTES`` or more are
    ``zmq.Frame(buffer, copy=False)``: ZeroMQ reads the tensor's own memory,
    so the caller must not modify a tensor in place after handing it to
    ``send`` (fresh activations never are). Smaller ones are copied, which is
    cheaper than the zero-copy bookkeeping at that size.
    """
    specs: list[dict[str, Any]] = []
    frames: list[Any] = [b""]
    for name, value, wire_dtype in tensors:
        if wire_dtype is not None and wire_dtype not in REDUCIBLE:
            raise ProtocolError(f"activation dtype must be one of {sorted(REDUCIBLE)}, not {wire_dtype!r}")
        arr, dtype, wire, kind, shape = _payload(value, wire_dtype)
        nbytes = arr.nbytes
        # A flat uint8 view of the same memory: every dtype (bool, 0-d, empty)
        # then exposes a plain byte buffer to ZeroMQ.
        flat = arr.reshape(-1).view(np.uint8)
        frames.append(zmq.Frame(flat, copy=nbytes < ZERO_COPY_MIN_BYTES))
        specs.append(
            TensorSpec(name, dtype, shape, nbytes, len(frames) - 1, kind, wire).to_wire()
        )
    header = {
        "version": PROTOCOL_VERSION,
        "type": type_name,
        "request_id": call_id,
        "seq": seq,
        "sender": sender,
        "fields": fields,
        "tensors": specs,
    }
    try:
        frames[0] = msgpack.packb(header, use_bin_type=True, default=_msgpack_default)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode {type_name}: {e}", call_id=call_id) from e
    return frames


def encode_compact(type_name: str, values: list[Any], *, call_id: int = 0) -> list[Any]:
    """One frame for a small message that crosses a slow link (a home's WAN uplink).

    The header is a msgpack *array* ``[version, type, call_id, [values...]]``:
    the values in the class's field order, trailing defaults left out. A map header
    spends ~50 bytes on key names alone, as much as a whole greedy verification round
    carries; which fields the positions mean is fixed by the message class on both
    ends. Compact messages have no tensor frames, no sender (the link's key says
    who sent it) and no sequence number.
    """
    try:
        return [msgpack.packb([PROTOCOL_VERSION, type_name, call_id, values], use_bin_type=True,
                              default=_msgpack_default)]
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode {type_name}: {e}", call_id=call_id) from e
