"""Device profiles: what one device measured about one model, as plain data.

A profile is the only input the planners need from a device, so it is a frozen
dataclass with a versioned JSON form (``schema_version`` 1) that the daemon can
ship around and that ``profiles/`` can hold for devices not measured yet.

Layers are indexed in *profile units*: unit 0 is the token embedding, units
1..L are the decoder layers 0..L-1 and unit L+1 is the head (final norm + LM
head). The embedding and head are timed as their own layers because the head of
a small-vocabulary model can cost as much as several decoder layers.

Latency functions (all vectorised over numpy arrays):

* ``layer_times(S)`` – t_l for every unit at sequence length ``S``: piecewise
  linear in S between the calibration lengths, linear extrapolation outside.
* ``q_layer(x, y)`` – one decoder layer processing a chunk of ``x`` new tokens
  with ``y`` tokens already in its KV cache. Decoder layers are architecturally
  identical, so one representative layer is measured on an (x, y) grid and the
  value is interpolated **bilinearly** in (x, y) (linear extrapolation beyond the
  grid). Why bilinear is good enough: per layer the work is
  ``a + b·x + c·x·y + d·x²`` (weights, attention over the cache, causal
  attention inside the chunk); bilinear interpolation reproduces the first three
  terms exactly and only misses the ``x²`` term between grid points, which with
  a doubling x-grid is a small share of the chunk's cost. The profiler measures
  off-grid points and stores the observed relative error in ``q_error``.
* ``embed_time(x)`` / ``head_time(x)`` – the embedding and head rows of t_l,
  interpolated in x (they do not depend on the cache length).
* ``decode_step(ctx)`` – one whole-model decode step at context ``ctx``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partition.errors import PartitionError
from partition.interpolate import bilinear, interp1

SCHEMA = "meshd.device-profile"
SCHEMA_VERSION = 1

#: Bytes per activation element of each numeric mode ("packed": 4-bit matrices, bfloat16 activations;
#: "gguf": the file's blocks, float32 activations).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "packed": 2, "packed4": 2, "gguf": 4}

#: Share of device memory the planner leaves to the OS and other apps by default.
DEFAULT_HEADROOM = 0.25

#: What one chunk costs a pipeline stage beyond its layers' compute, when the profile has no
#: measurement of its own: taking the message off the socket, decrypting and decoding it,
#: dispatching the forward, encoding and sending the result. Measured on the reference
#: machine by ``bench/pipeline.py --chunk-sweep`` (bench/RESULTS.md, "Where prefill time goes").
DEFAULT_MESSAGE_OVERHEAD_S = 0.005


class ProfileError(PartitionError):
    """A profile file that is missing, unreadable or does not follow the schema."""


@dataclass(frozen=True)
class ModelInfo:
    """The model a profile was measured with; planners refuse to mix models."""

    identity: str
    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool


@dataclass(frozen=True)
class QGrid:
    """Per-decoder-layer latency of a chunk of ``x`` tokens after ``y`` cached ones."""

    x: tuple[int, ...]
    y: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [len(x)][len(y)]

    def __call__(self, x, y):
        return bilinear(self.x, self.y, self.seconds, x, y)


@dataclass(frozen=True)
class DeviceProfile:
    device_id: str
    model: ModelInfo
    dtype: str
    threads: int
    torch_version: str
    measured_at: str
    calib_seq_lens: tuple[int, ...]
    #: t_l: [L+2][len(calib_seq_lens)] seconds (embedding, decoder layers, head)
    layer_latency_s: tuple[tuple[float, ...], ...]
    q: QGrid
    decode_context: tuple[int, ...]
    decode_step_s: tuple[float, ...]
    min_chunk: int
    #: weight bytes per unit (embedding, decoder layers, head); L+2 entries
    weight_bytes: tuple[int, ...]
    kv_bytes_per_token_per_layer: int
    memory_total_bytes: int
    memory_headroom: float
    memory_budget_bytes: int
    q_error: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    scaled_from: dict | None = None
    #: per-chunk cost at a stage that ``q`` misses (see DEFAULT_MESSAGE_OVERHEAD_S); None = not
    #: measured. Optional in schema v1: profiles written before it existed still load.
    message_overhead_s: float | None = None

    # -- derived values -------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def chunk_overhead_s(self) -> float:
        """The fixed per-chunk stage cost the planners add to every chunk's compute."""
        return DEFAULT_MESSAGE_OVERHEAD_S if self.message_overhead_s is None else self.message_overhead_s

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def layer_times(self, seq_len) -> np.ndarray:
        """t_l for every profile unit at sequence length ``seq_len`` → array [L+2]."""
        t = np.asarray(self.layer_latency_s, dtype=float)
        return np.array([float(interp1(self.calib_seq_lens, row, seq_len)) for row in t])

    def q_layer(self, x, y):
        """One decoder layer: chunk of ``x`` tokens with ``y`` tokens already cached."""
        return self.q(x, y)

    def embed_time(self, x):
        return interp1(self.calib_seq_lens, self.layer_latency_s[0], x)

    def head_time(self, x):
        return interp1(self.calib_seq_lens, self.layer_latency_s[-1], x)

    def decode_step(self, context):
        return interp1(self.decode_context, self.decode_step_s, context)

    def full_model_time(self, seq_len: int) -> float:
        """Whole-model prefill of ``seq_len`` tokens on this device alone."""
        return float(self.layer_times(seq_len).sum())

    # -- (de)serialisation ----------------------------------------------

    def to_dict(self) -> dict:
        d = asdict(self)
        out: dict[str, Any] = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION}
        out.update(d)
        out["q"] = {"x": list(self.q.x), "y": list(self.q.y),
                    "seconds": [list(r) for r in self.q.seconds], "interpolation": "bilinear"}
        return _jsonable(out)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        validate(data)
        q = data["q"]
        return cls(
            device_id=data["device_id"],
            model=ModelInfo(**data["model"]),
            dtype=data["dtype"],
            threads=int(data["threads"]),
            torch_version=data["torch_version"],
            measured_at=data["measured_at"],
            calib_seq_lens=tuple(int(v) for v in data["calib_seq_lens"]),
            layer_latency_s=tuple(tuple(float(v) for v in row) for row in data["layer_latency_s"]),
            q=QGrid(tuple(int(v) for v in q["x"]), tuple(int(v) for v in q["y"]),
                    tuple(tuple(float(v) for v in row) for row in q["seconds"])),
            decode_context=tuple(int(v) for v in data["decode_context"]),
            decode_step_s=tuple(float(v) for v in data["decode_step_s"]),
            min_chunk=int(data["min_chunk"]),
            weight_bytes=tuple(int(v) for v in data["weight_bytes"]),
            kv_bytes_per_token_per_layer=int(data["kv_bytes_per_token_per_layer"]),
            memory_total_bytes=int(data["memory_total_bytes"]),
            memory_headroom=float(data["memory_headroom"]),
            memory_budget_bytes=int(data["memory_budget_bytes"]),
            q_error=dict(data.get("q_error") or {}),
            settings=dict(data.get("settings") or {}),
            host=dict(data.get("host") or {}),
            scaled_from=data.get("scaled_from"),
            message_overhead_s=(None if data.get("message_overhead_s") is None
                                else float(data["message_overhead_s"])),
        )


# -- validation, load/save --------------------------------------------------------

_REQUIRED = {
    "device_id": str, "model": dict, "dtype": str, "threads": int, "torch_version": str,
    "measured_at": str, "calib_seq_lens": list, "layer_latency_s": list, "q": dict,
    "decode_context": list, "decode_step_s": list, "min_chunk": int, "weight_bytes": list,
    "kv_bytes_per_token_per_layer": int, "memory_total_bytes": int,
    "memory_headroom": (int, float), "memory_budget_bytes": int,
}


def _fail(where: str, msg: str):
    raise ProfileError(f"profile {where}: {msg}")


def _increasing(values, where):
    if len(values) < 1 or any(b <= a for a, b in zip(values, values[1:])):
        _fail(where, "must be a non-empty, strictly increasing list")


def _non_negative_numbers(values, where):
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            _fail(where, f"must hold finite non-negative numbers, found {v!r}")


def validate(data: Any) -> None:
    """Raise :class:`ProfileError` naming the first field that breaks schema v1."""
    if not isinstance(data, dict):
        _fail("", "must be a JSON object")
    if data.get("schema") != SCHEMA:
        _fail("schema", f"expected {SCHEMA!r}, found {data.get('schema')!r}")
    if data.get("schema_version") != SCHEMA_VERSION:
        _fail("schema_version", f"this meshd reads version {SCHEMA_VERSION}, "
              f"found {data.get('schema_version')!r}")
    for key, typ in _REQUIRED.items():
        if key not in data:
            _fail(key, "is missing")
        if not isinstance(data[key], typ) or isinstance(data[key], bool):
            _fail(key, f"has the wrong type ({type(data[key]).__name__})")
    try:
        model = ModelInfo(**data["model"])
    except TypeError as exc:
        _fail("model", str(exc))
    if data["dtype"] not in DTYPE_BYTES:
        _fail("dtype", f"unknown dtype {data['dtype']!r}")
    units = model.num_layers + 2
    _increasing(data["calib_seq_lens"], "calib_seq_lens")
    rows = data["layer_latency_s"]
    if len(rows) != units:
        _fail("layer_latency_s", f"needs {units} rows (embedding, {model.num_layers} layers, "
              f"head), found {len(rows)}")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(data["calib_seq_lens"]):
            _fail(f"layer_latency_s[{i}]", "needs one value per calibration length")
        _non_negative_numbers(row, f"layer_latency_s[{i}]")
    q = data["q"]
    for key in ("x", "y", "seconds"):
        if key not in q:
            _fail(f"q.{key}", "is missing")
    _increasing(q["x"], "q.x")
    _increasing(q["y"], "q.y")
    if len(q["x"]) < 2 or len(q["y"]) < 2:
        _fail("q", "the grid needs at least two points in x and in y")
    if len(q["seconds"]) != len(q["x"]) or any(
        not isinstance(r, list) or len(r) != len(q["y"]) for r in q["seconds"]
    ):
        _fail("q.seconds", "must be a len(x) × len(y) matrix")
    for r in q["seconds"]:
        _non_negative_numbers(r, "q.seconds")
    _increasing(data["decode_context"], "decode_context")
    if len(data["decode_step_s"]) != len(data["decode_context"]):
        _fail("decode_step_s", "needs one value per decode context")
    _non_negative_numbers(data["decode_step_s"], "decode_step_s")
    if len(data["weight_bytes"]) != units:
        _fail("weight_bytes", f"needs {units} entries, found {len(data['weight_bytes'])}")
    _non_negative_numbers(data["weight_bytes"], "weight_bytes")
    if data["min_chunk"] < 1:
        _fail("min_chunk", "must be at least 1")
    overhead = data.get("message_overhead_s")
    if overhead is not None:
        _non_negative_numbers([overhead], "message_overhead_s")
    if data["threads"] < 1:
        _fail("threads", "must be at least 1")
    if not 0 <= data["memory_headroom"] < 1:
        _fail("memory_headroom", "must be a fraction in [0, 1)")
    if data["memory_budget_bytes"] < 0 or data["memory_total_bytes"] < 0:
        _fail("memory_budget_bytes", "must be non-negative")


def load(path: str | os.PathLike) -> DeviceProfile:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"no profile at {p}") from None
    except (OSError, ValueError) as exc:
        raise ProfileError(f"cannot read profile {p}: {exc}") from None
    try:
        return DeviceProfile.from_dict(data)
    except ProfileError as exc:
        raise ProfileError(f"{p}: {exc}") from None


def dumps(profile: DeviceProfile) -> str:
    """Deterministic, diff-friendly JSON (one number list per line)."""
    return json.dumps(profile.to_dict(), indent=1, sort_keys=False) + "\n"


def save(profile: DeviceProfile, path: str | os.PathLike) -> Path:
    """Write atomically so a reader never sees half a profile."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(dumps(profile))
    os.replace(tmp, p)
    return p


def _jsonable(v):
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, (np.integer,)):
        return int(v)
    return v


# -- memory ------------------------------------------------------------------------


def memory_budget(total_bytes: int, headroom: float = DEFAULT_HEADROOM) -> int:
    """Bytes the planner may fill on a device with ``total_bytes`` of memory."""
    return int(total_bytes * (1.0 - headroom))
