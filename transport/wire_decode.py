"""The receiving side of the wire: a header checked in full before any tensor is touched.

Frames come from a peer that may be broken or hostile, so everything a tensor decode
later relies on (dtype allowed, byte length == dtype x shape, frame present and of
that length, the limits) is checked on the header first (:func:`decode_header`), and
anything malformed is a ``ProtocolError`` naming what is wrong, never a crash. A
tensor is then rebuilt over the frame's own memory (:func:`decode_tensor`). The
format and the sending side are ``transport.wire``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import msgpack
import numpy as np
import torch
import zmq

from transport.errors import ProtocolError
from transport.wire import (
    DEFAULT_LIMITS,
    DTYPES,
    KINDS,
    PROTOCOL_VERSION,
    REDUCIBLE,
    Header,
    Limits,
    TensorSpec,
    stats,
)

__all__ = ["decode_header", "decode_tensor"]


_HEADER_KEYS = frozenset({"version", "type", "request_id", "seq", "sender", "fields", "tensors"})
_DESCRIPTOR_KEYS = frozenset({"name", "dtype", "shape", "nbytes", "frame", "kind", "wire_dtype"})


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    return memoryview(frame)


def _frame_len(frame: Any) -> int:
    if isinstance(frame, zmq.Frame):
        return len(frame)
    return memoryview(frame).nbytes


def _is_uint(v: Any, bits: int = 64) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << bits)


def decode_header(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Header:
    """Parse and validate frame 0 against the frames that follow it.

    Everything a tensor decode later relies on (dtype allowed, byte length ==
    dtype x shape, frame present and of that length, limits) is checked here,
    so a message that passes can be rebuilt without further surprises.
    """
    if len(frames) == 0:
        raise ProtocolError("empty message (no header frame)")
    if len(frames) > limits.max_frames:
        raise ProtocolError(f"message has {len(frames)} frames, limit is {limits.max_frames}")
    lengths = [_frame_len(f) for f in frames]
    hlen = lengths[0]
    if hlen > limits.max_header_bytes:
        raise ProtocolError(f"header is {hlen} bytes, limit is {limits.max_header_bytes}",
                            call_id=_peek_call_id(frames[0]))
    total = sum(lengths)
    if total > limits.max_total_bytes:
        raise ProtocolError(f"message is {total} bytes, limit is {limits.max_total_bytes}",
                            call_id=_peek_call_id(frames[0]))
    try:
        raw = msgpack.unpackb(_buffer(frames[0]), raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if isinstance(raw, list):
        return _compact_header(raw, len(frames))
    if not isinstance(raw, dict):
        raise ProtocolError(f"header must be a map, got {type(raw).__name__}")

    rid = raw.get("request_id", 0)
    rid = rid if _is_uint(rid) else 0

    def fail(msg: str) -> ProtocolError:
        return ProtocolError(msg, call_id=rid)

    version = raw.get("version")
    if version != PROTOCOL_VERSION:
        raise fail(f"unsupported protocol version {version!r} (this node speaks {PROTOCOL_VERSION})")
    unknown = raw.keys() - _HEADER_KEYS
    if unknown:
        raise fail(f"unknown header keys: {sorted(map(str, unknown))}")
    type_name = raw.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise fail("header has no message type")
    if not _is_uint(raw.get("request_id", 0)):
        raise fail("request_id must be an unsigned 64-bit integer")
    seq = raw.get("seq", 0)
    if not _is_uint(seq):
        raise fail("seq must be an unsigned 64-bit integer")
    sender = raw.get("sender", "")
    if not isinstance(sender, str):
        raise fail("sender must be a string")
    fields = raw.get("fields", {})
    if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
        raise fail("fields must be a map with string keys")
    descs = raw.get("tensors", [])
    if not isinstance(descs, list):
        raise fail("tensors must be a list")
    if len(descs) != len(frames) - 1:
        raise fail(
            f"{type_name}: header describes {len(descs)} tensor(s) but {len(frames) - 1} "
            f"tensor frame(s) arrived"
        )

    specs: list[TensorSpec] = []
    names: set[str] = set()
    for i, d in enumerate(descs, start=1):
        specs.append(_tensor_spec(d, i, lengths[i], names, limits, fail, type_name))
    return Header(type_name, rid, seq, sender, fields, specs, version)


def _peek_call_id(frame: Any) -> int:
    """The request id of a header too large to decode, read from its first entries only, so the
    sender's request fails with the size error at once instead of timing out (0 if unreadable)."""
    try:
        u = msgpack.Unpacker(raw=False, max_buffer_size=2 ** 31 - 1)
        u.feed(_buffer(frame))
        try:
            n = u.read_array_header()
            if n >= 3:
                u.skip()
                u.skip()
                rid = u.unpack()
                return rid if _is_uint(rid) else 0
            return 0
        except msgpack.UnpackValueError:
            pass
        u = msgpack.Unpacker(raw=False, max_buffer_size=2 ** 31 - 1)
        u.feed(_buffer(frame))
        for _ in range(min(u.read_map_header(), 4)):
            if u.unpack() == "request_id":
                rid = u.unpack()
                return rid if _is_uint(rid) else 0
            u.skip()
    except Exception:  # noqa: BLE001 - best effort on a message we refuse anyway
        pass
    return 0


def _compact_header(raw: list, nframes: int) -> Header:
    """The array header of :func:`encode_compact`; ``fields`` stays a list (the class maps positions)."""
    rid = raw[2] if len(raw) > 2 and _is_uint(raw[2]) else 0
    if len(raw) != 4:
        raise ProtocolError(f"a compact header has 4 entries, got {len(raw)}", call_id=rid)
    version, type_name, _, values = raw
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this node speaks {PROTOCOL_VERSION})",
                            call_id=rid)
    if not isinstance(type_name, str) or not type_name:
        raise ProtocolError("header has no message type", call_id=rid)
    if not _is_uint(raw[2]):
        raise ProtocolError("request_id must be an unsigned 64-bit integer", call_id=rid)
    if not isinstance(values, list):
        raise ProtocolError(f"{type_name}: compact values must be a list", call_id=rid)
    if nframes != 1:
        raise ProtocolError(f"{type_name}: a compact message has no tensor frames, got {nframes - 1}",
                            call_id=rid)
    return Header(type_name, rid, 0, "", values, [], version)  # type: ignore[arg-type]


def _tensor_spec(d, index, got, names, limits, fail, type_name) -> TensorSpec:
    if not isinstance(d, dict):
        raise fail(f"{type_name}: tensor descriptor {index} is not a map")
    extra = d.keys() - _DESCRIPTOR_KEYS
    if extra:
        raise fail(f"{type_name}: tensor descriptor {index} has unknown keys {sorted(map(str, extra))}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise fail(f"{type_name}: tensor descriptor {index} has no name")
    if name in names:
        raise fail(f"{type_name}: tensor {name!r} appears twice")
    names.add(name)
    dtype = d.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise fail(f"{type_name}.{name}: dtype {dtype!r} is not allowed (allowed: {', '.join(DTYPES)})")
    wire = d.get("wire_dtype", dtype)
    if wire != dtype and not (dtype == "float32" and isinstance(wire, str) and wire in REDUCIBLE):
        raise fail(f"{type_name}.{name}: cannot restore {dtype!r} from wire dtype {wire!r}")
    kind = d.get("kind", "torch")
    if not isinstance(kind, str) or kind not in KINDS:
        raise fail(f"{type_name}.{name}: kind must be 'torch' or 'numpy', not {kind!r}")
    shape = d.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > limits.max_ndim
        or not all(_is_uint(s, 63) for s in shape)
    ):
        raise fail(
            f"{type_name}.{name}: shape must be a list of at most {limits.max_ndim} "
            f"non-negative integers, got {shape!r}"
        )
    nbytes = d.get("nbytes")
    if not _is_uint(nbytes):
        raise fail(f"{type_name}.{name}: nbytes must be a non-negative integer")
    expected = math.prod(shape) * DTYPES[wire].itemsize
    if nbytes != expected:
        raise fail(
            f"{type_name}.{name}: nbytes {nbytes} does not match {wire} x {tuple(shape)} = {expected}"
        )
    if nbytes > limits.max_tensor_bytes:
        raise fail(f"{type_name}.{name}: {nbytes} bytes exceeds the tensor limit {limits.max_tensor_bytes}")
    if d.get("frame") != index or isinstance(d.get("frame"), bool):
        raise fail(f"{type_name}.{name}: frame index {d.get('frame')!r} should be {index}")
    if got != nbytes:
        raise fail(f"{type_name}.{name}: frame {index} holds {got} bytes, header says {nbytes}")
    return TensorSpec(name, dtype, tuple(shape), nbytes, index, kind, wire)


def decode_tensor(frame: Any, spec: TensorSpec, kind: str | None = None) -> torch.Tensor | np.ndarray:
    """Rebuild a tensor over the frame's memory (no copy).

    The result keeps the frame alive through numpy's ``base`` chain. Copies
    happen only where the bytes cannot be used as they are, and are counted in
    ``stats``: a payload not aligned to its item size (libzmq packs small
    messages into a shared buffer) and reduced-precision payloads restored to
    float32. ``kind`` overrides the sender's choice of torch/numpy.
    """
    kind = kind or spec.kind
    wire = DTYPES[spec.wire_dtype]
    if kind == "numpy" and spec.dtype == "bfloat16":
        raise ProtocolError(f"{spec.name}: bfloat16 cannot be received as a numpy array (use torch)")
    if spec.nbytes == 0:  # nothing to share; build a normal (well-strided) empty tensor
        if kind == "numpy":
            return np.empty(spec.shape, dtype=DTYPES[spec.dtype].numpy)
        return torch.empty(spec.shape, dtype=DTYPES[spec.dtype].torch)
    arr = np.frombuffer(_buffer(frame), dtype=wire.numpy)
    if not arr.flags.aligned:
        stats.unaligned_copies += 1
        arr = arr.copy()
    arr = arr.reshape(spec.shape)
    if spec.wire_dtype == "bool" and arr.view(np.uint8).max() > 1:
        # Any byte other than 0/1 is not a bool; torch would carry it as UB.
        raise ProtocolError(f"{spec.name}: bool tensor holds bytes other than 0 and 1")

    if kind == "numpy" and spec.wire_dtype == spec.dtype:
        return arr

    if arr.flags.writeable:
        t = torch.from_numpy(arr)
    else:
        # Frames from pyzmq's Cython backend are writable; other backends or
        # bytes objects give a read-only buffer. Sharing it is still safe: the
        # frame is ours alone, nobody else reads those bytes after us, so the
        # "undefined behaviour on write" torch warns about cannot bite.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(arr)
    if spec.wire_dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    if spec.wire_dtype != spec.dtype:
        t = t.to(DTYPES[spec.dtype].torch)
    if kind == "numpy":
        return t.numpy()
    return t
