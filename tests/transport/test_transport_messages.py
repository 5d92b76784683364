"""Typed messages: every mesh message round-trips, and the decoder, fed random
or mutated frames, either returns a well-typed message or raises ProtocolError."""

from __future__ import annotations

import dataclasses
import struct
import math
import os

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding.penalties import Penalties
from decoding.sampling import SamplingParams, SamplingSpec
from transport import cloud_messages as C
from transport import messages as M
from transport import stage_messages as S
from transport.errors import ProtocolError
from transport.hints import BAD, coerce
from transport.messages import Envelope, decode, encode
from transport.registry import message, registry, spec_of

# TRANSPORT_FUZZ_EXAMPLES=20000 for a deeper hunt; the default keeps the suite fast.
FAST = settings(
    max_examples=int(os.environ.get("TRANSPORT_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

EXAMPLES = [
    M.Hello("kitchen", 3, "ab12-cd34-ef56-7890", "tcp://10.0.0.2:5710"),
    M.HelloReply("laptop", 3, "1111-2222-3333-4444", accepted=False, reason="stale plan"),
    M.LinkProbe("kitchen", "serving", 0.5, 3, 1_700_000_000.25),
    M.LinkProbeAck("laptop", 3, 1_700_000_000.5),
    S.StageForward(
        "req-1", 3, "kitchen/ab12/17", 128, chunk_index=2, hidden=torch.randn(64, 576),
        tree_mask=torch.tril(torch.ones(4, 4, dtype=torch.bool)),
        sampling=SamplingSpec(SamplingParams(temperature=0.7, top_p=0.9, seed=42)), sample_step=3, capacity=512,
        reply_to="tcp://10.0.0.1:5710", is_last_chunk=False,
    ),
    S.StageForward(
        "req-3", 3, "kitchen/ab12/19", 0, token_ids=torch.arange(4), prompt_tail=[1, 2], history=[],
        sampling=SamplingSpec(SamplingParams(0.9, 40, seed=7), Penalties(presence=0.5, repeat=1.2),
                              {"type": "json_object"}),
    ),
    S.StageForward("req-2", 3, "kitchen/ab12/18", 0, token_ids=torch.arange(32)),
    S.TokenResult(
        "req-1", 3, "kitchen/ab12/17", torch.tensor([42]), topk_ids=torch.tensor([[42, 7, 1]]),
        topk_probs=torch.tensor([[0.8, 0.15, 0.05]]), logprobs=[-0.22],
    ),
    S.Truncate(3, "kitchen/ab12/17", 140),
    S.FreeSequence(3, "kitchen/ab12/17"),
    S.ForkSequence(3, "kitchen/ab12/19", "kitchen/ab12/17", 128),
    S.PrefixProbe(3, torch.tensor([1, 2, 3], dtype=torch.long)),
    S.PrefixMatch(3, 2),
    S.ReusePrefix("req-1", 3, "kitchen/ab12/21", torch.tensor([1, 2], dtype=torch.long), 300, "kitchen|tcp://x:1"),
    S.CacheSequence(3, "kitchen/ab12/17"),
    S.StageProgress("laptop", ["kitchen/ab12/17", "kitchen/ab12/19"], 90_112),
    M.Ack(3, "ok"),
    M.ErrorReply("stale_plan", "plan 2 is older than 3", "req-1"),
    M.PlanUpdate(4, {"kitchen": {"layers": [0, 12], "next": "laptop"}, "laptop": {"layers": [12, 24]}}),
    C.CloudVerify(3, 412, struct.pack("<5I", 151000, 15, 16, 17, 18), 4),
    C.CloudVerify(4, 0, struct.pack("<3I", 1, 2, 3), 2, q=[struct.pack("<If", 7, 1.0)] * 2,
                  open={"temperature": 0.7, "top_k": 40, "seed": 5, "draws": 0, "capacity": 300}),
    C.CloudVerdict(3, 2, 151000, 17),
    C.CloudClose(3),
    C.CloudMembers(["rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7", "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"]),
    C.CloudVerify(5, 96, struct.pack("<3I", 1, 2, 3), 2, previews=60),
    C.CloudPreview(5, 99, 1, 4207, 0.8125, 15),
    C.CloudHello(),
    C.CloudHello([11, 15, 20, 24]),
]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def _same_message(a, b) -> bool:
    return type(a) is type(b) and all(
        _equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
    )


def test_every_message_of_the_mesh_has_an_example_here():
    ours = {cls for cls in registry().values() if cls.__module__ in (M.__name__, S.__name__, C.__name__)}
    assert ours == {type(m) for m in EXAMPLES}


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_mesh_message_round_trips(msg):
    env = decode(encode(msg, call_id=99, seq=5, sender="kitchen"))
    compact = type(msg).__name__.startswith("Cloud")  # the WAN messages: no sender, the CURVE key says who
    assert (env.call_id, env.seq, env.sender) == (99, 0, "") if compact else (99, 5, "kitchen")
    assert _same_message(env.message, msg)


def test_envelope_and_keyword_forms_encode_the_same():
    msg = S.FreeSequence(1, "n/x/2")
    assert encode(Envelope(msg, 7, 3, "n")) == encode(msg, call_id=7, seq=3, sender="n")


def test_numpy_scalars_in_header_fields_travel_as_python_values():
    spec = SamplingSpec(SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3)))
    got = decode(encode(S.StageForward("r", 1, "n/x/0", 0, sampling=spec)))
    p = got.message.sampling.params
    assert (p.temperature, p.top_k) == (0.5, 3) and (type(p.temperature), type(p.top_k)) == (float, int)


def test_unregistered_objects_cannot_be_encoded():
    with pytest.raises(ProtocolError, match="not a registered message type"):
        encode(object())
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(M.Ack(detail=object()))


def test_registry_refuses_duplicates_and_unverifiable_field_types():
    with pytest.raises(TypeError, match="already registered"):

        @message(name="Ack")
        class Other:
            x: int = 0

    with pytest.raises(TypeError, match="unsupported field type"):

        @message(name="TestBadHint")
        class Bad:
            x: set = dataclasses.field(default_factory=set)


def test_a_message_is_a_frozen_dataclass():
    """A decoded message is a value a handler may keep or pass on; a changed one is built anew."""
    with pytest.raises(TypeError, match="frozen"):

        @message(name="TestMutable")
        @dataclasses.dataclass
        class Mutable:
            x: int = 0

    assert all(cls.__dataclass_params__.frozen for cls in registry().values())
    ack = decode(encode(M.Ack(3, "ok"))).message
    with pytest.raises(dataclasses.FrozenInstanceError):
        ack.detail = "changed"
    assert dataclasses.replace(ack, detail="changed") == M.Ack(3, "changed")


def test_missing_required_field_is_a_protocol_error():
    frames = encode(S.Truncate(1, "s2", 3))
    h = msgpack.unpackb(frames[0])
    del h["fields"]["new_length"]
    with pytest.raises(ProtocolError, match="missing field.*new_length"):
        decode([msgpack.packb(h)])


def test_unknown_field_is_a_protocol_error():
    frames = encode(S.Truncate(1, "s2", 3))
    h = msgpack.unpackb(frames[0])
    h["fields"]["surprise"] = 1
    with pytest.raises(ProtocolError, match="no field 'surprise'"):
        decode([msgpack.packb(h)])


@message(name="TestExtensibleGossip", extensible=True)
@dataclasses.dataclass(frozen=True)
class Gossip:
    name: str
    load: float = 0.0


@message(name="TestExtensibleTensorGossip", extensible=True)
@dataclasses.dataclass(frozen=True)
class TensorGossip:
    name: str
    sketch: torch.Tensor | None = None


def test_an_extensible_message_leaves_out_fields_it_does_not_know_and_names_them():
    # what a newer peer's liveness gossip looks like to this version
    h = msgpack.unpackb(encode(Gossip("kitchen", 0.5))[0])
    h["fields"]["plan_digest"] = "ab12"
    h["fields"]["zone"] = {"nested": [1, 2]}
    env = decode([msgpack.packb(h)])
    assert env.message == Gossip("kitchen", 0.5)
    assert env.unknown_fields == ("plan_digest", "zone")
    assert decode(encode(Gossip("kitchen"))).unknown_fields == ()


def test_an_extensible_message_sends_only_fields_off_their_default():
    # so a field added in a newer version reaches an older peer only when it is set
    assert msgpack.unpackb(encode(Gossip("kitchen"))[0])["fields"] == {"name": "kitchen"}
    assert msgpack.unpackb(encode(Gossip("kitchen", 0.5))[0])["fields"] == {"name": "kitchen", "load": 0.5}
    assert decode(encode(Gossip("kitchen"))).message == Gossip("kitchen")
    # a strict message still sends everything
    assert "new_length" in msgpack.unpackb(encode(S.Truncate(1, "s2", 0))[0])["fields"]


def test_a_field_added_later_to_a_strict_message_travels_only_when_set():
    """``later()``: an older peer decodes every message that leaves the new field at its default."""
    hello = msgpack.unpackb(encode(M.HelloReply("a", 1, ""))[0])["fields"]
    assert "exits" not in hello and decode(encode(M.HelloReply("a", 1, ""))).message.exits == 0
    assert msgpack.unpackb(encode(M.HelloReply("a", 1, "", exits=3))[0])["fields"]["exits"] == 3
    fwd = S.StageForward(request_id="r", plan_version=1, seq_id="s", position_offset=0)
    assert "exit_threshold" not in msgpack.unpackb(encode(fwd)[0])["fields"]
    set_ = dataclasses.replace(fwd, exit_threshold=0.7)
    assert decode(encode(set_)).message.exit_threshold == 0.7


def test_unknown_tensor_frames_of_an_extensible_message_are_left_out_too():
    frames = encode(TensorGossip("kitchen", torch.ones(3)))
    h = msgpack.unpackb(frames[0])
    h["tensors"][0]["name"] = "sketch_v2"
    env = decode([msgpack.packb(h), *frames[1:]])
    assert env.message == TensorGossip("kitchen") and env.unknown_fields == ("sketch_v2",)


def test_a_header_naming_thousands_of_unknown_fields_keeps_a_bounded_list():
    h = msgpack.unpackb(encode(Gossip("kitchen"))[0])
    h["fields"].update({f"f{i:05d}": i for i in range(5000)})
    env = decode([msgpack.packb(h)])
    assert len(env.unknown_fields) == M.MAX_UNKNOWN_NAMED + 1 and env.unknown_fields[-1] == "... 4984 more"


def test_an_extensible_message_still_checks_the_fields_it_knows():
    h = msgpack.unpackb(encode(Gossip("kitchen"))[0])
    h["fields"]["load"] = "high"
    with pytest.raises(ProtocolError, match="load should be"):
        decode([msgpack.packb(h)])
    del h["fields"]["name"]
    h["fields"]["load"] = 1.0
    with pytest.raises(ProtocolError, match="missing field.*name"):
        decode([msgpack.packb(h)])


def test_a_compact_message_cannot_be_extensible():
    with pytest.raises(TypeError, match="positional"):
        @message(name="TestCompactExtensible", compact=True, extensible=True)
        @dataclasses.dataclass
        class _Bad:
            a: int = 0


# ---------------------------------------------------------------- properties


@message(name="TestPropertyProbe")
@dataclasses.dataclass(frozen=True)
class Probe:
    a: torch.Tensor | None = None
    b: np.ndarray | None = None
    label: str = ""
    count: int = 0
    weights: list[float] = dataclasses.field(default_factory=list)
    extra: dict[str, int | str | None] = dataclasses.field(default_factory=dict)


DTYPES = ["float32", "float16", "bfloat16", "int64", "bool", "int32", "uint8", "float64"]


@st.composite
def tensors(draw, kind="torch"):
    dtype = draw(st.sampled_from([d for d in DTYPES if kind == "torch" or d != "bfloat16"]))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    n = math.prod(shape)
    itemsize = {"float64": 8, "int64": 8, "float32": 4, "int32": 4}.get(dtype, 2 if "16" in dtype else 1)
    raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    if dtype == "bool":
        raw = bytes(x & 1 for x in raw)
    np_dtype = {"bfloat16": np.uint16}.get(dtype, dtype)
    arr = np.frombuffer(raw, dtype=np_dtype).reshape(shape).copy()
    if kind == "numpy":
        return arr
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _bits(x):
    """Compare tensors by their bytes so NaN payloads count as equal."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape), x.contiguous().numpy().tobytes() if x.dtype != torch.bfloat16 else x.view(torch.int16).numpy().tobytes())
    return (x.dtype, x.shape, x.tobytes())


@FAST
@given(
    a=st.none() | tensors("torch"),
    b=st.none() | tensors("numpy"),
    label=st.text(max_size=20),
    count=st.integers(-(2**63), 2**63 - 1),
    weights=st.lists(st.floats(allow_nan=False), max_size=5),
    extra=st.dictionaries(st.text(max_size=5), st.none() | st.integers(-5, 5) | st.text(max_size=5), max_size=4),
    rid=st.integers(0, 2**64 - 1),
)
def test_encode_then_decode_is_the_identity(a, b, label, count, weights, extra, rid):
    msg = Probe(a, b, label, count, weights, extra)
    env = decode(encode(msg, call_id=rid, seq=1, sender="s"))
    got = env.message
    assert env.call_id == rid
    assert (got.a is None) == (a is None) and (got.b is None) == (b is None)
    if a is not None:
        assert _bits(got.a) == _bits(a)
    if b is not None:
        assert _bits(got.b) == _bits(b)
    assert (got.label, got.count, got.weights, got.extra) == (label, count, weights, extra)


def _assert_valid_or_protocol_error(frames):
    """The decoder's contract: a well-typed registered message, or ProtocolError."""
    try:
        env = decode(frames)
    except ProtocolError:
        return
    cls = type(env.message)
    assert cls in registry().values()
    header = M.header_values(env.message)
    for f in spec_of(cls).fields:
        value = header[f.name] if f.tensor_kind is None else getattr(env.message, f.name)
        if f.tensor_kind is None:
            assert coerce(value, f.hint) is not BAD, (f.name, value)
        else:
            assert value is None or isinstance(value, (torch.Tensor, np.ndarray))
    assert all(isinstance(n, str) for n in env.unknown_fields)
    assert not set(env.unknown_fields) & set(spec_of(cls).by_name)
    assert len(env.unknown_fields) <= M.MAX_UNKNOWN_NAMED + 1


@FAST
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_decoder_never_crashes_on_random_frames(frames):
    _assert_valid_or_protocol_error(frames)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)

_VALID = [encode(m, call_id=3) for m in EXAMPLES if not type(m).__name__.startswith("Cloud")] + [
    encode(Probe(torch.zeros(2, 3), np.ones(4, dtype=bool), "x", 1, [0.5], {"k": 1})),
    encode(Gossip("kitchen", 0.5)),
    encode(TensorGossip("kitchen", torch.ones(3))),
]


@FAST
@given(
    which=st.integers(0, len(_VALID) - 1),
    where=st.sampled_from(["top", "fields", "tensor"]),
    key=st.sampled_from(
        ["version", "type", "request_id", "seq", "sender", "fields", "tensors", "name", "dtype",
         "shape", "nbytes", "frame", "kind", "wire_dtype", "sample_step", "seq_id", "hidden", "zzz"]
    ),
    value=msgpack_values,
    delete=st.booleans(),
)
def test_decoder_never_crashes_on_mutated_headers(which, where, key, value, delete):
    frames = _VALID[which]
    h = msgpack.unpackb(frames[0], strict_map_key=False)
    target = {"top": h, "fields": h["fields"], "tensor": h["tensors"][0] if h["tensors"] else h}[where]
    if delete:
        target.pop(key, None)
    else:
        target[key] = value
    _assert_valid_or_protocol_error([msgpack.packb(h, use_bin_type=True), *frames[1:]])


@FAST
@given(
    which=st.integers(0, len(_VALID) - 1),
    cuts=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    truncate=st.none() | st.integers(0, 10_000),
    drop_frame=st.none() | st.integers(0, 5),
)
def test_decoder_never_crashes_on_corrupted_bytes(which, cuts, truncate, drop_frame):
    frames = [bytes(f.bytes) if hasattr(f, "bytes") else bytes(f) for f in _VALID[which]]
    header = bytearray(frames[0])
    for pos, byte in cuts:
        header[pos % len(header)] = byte
    if truncate is not None:
        header = header[: truncate % (len(header) + 1)]
    frames[0] = bytes(header)
    if drop_frame is not None and len(frames) > 1:
        del frames[1 + drop_frame % (len(frames) - 1)]
    _assert_valid_or_protocol_error(frames)


# ------------------------------------------------------------------ compact messages (a home's WAN uplink)

def test_a_greedy_verification_round_fits_in_fifty_bytes_each_way():
    up = encode(C.CloudVerify(123, 4000, struct.pack("<5I", 151000, 151001, 151002, 151003, 151004), 4),
                call_id=70000, seq=70000)
    down = encode(C.CloudVerdict(123, 4, 151005, 0), call_id=70000, seq=70000)
    assert len(up) == 1 and len(up[0]) <= 50
    assert len(down) == 1 and len(down[0]) <= 50


def test_a_preview_costs_a_home_about_as_much_downlink_as_a_verdict():
    preview = encode(C.CloudPreview(123, 4005, 2, 151005, 0.9375, 20), call_id=0, seq=70000)
    assert len(preview) == 1 and len(preview[0]) <= 50


def test_compact_messages_leave_trailing_defaults_out():
    bare = encode(C.CloudVerify(1, 0, b"\x00" * 8, 1))[0]
    full = encode(C.CloudVerify(1, 0, b"\x00" * 8, 1, open={"seed": 1}))[0]
    assert len(bare) < len(full)
    assert decode([bare]).message.open is None and decode([full]).message.open == {"seed": 1}


@pytest.mark.parametrize("header, error", [
    ([1, "CloudClose", 0], "4 entries"),
    ([2, "CloudClose", 0, [1]], "version"),
    ([1, "CloudClose", -1, [1]], "unsigned"),
    ([1, "CloudClose", 0, {"session": 1}], "must be a list"),
    ([1, "CloudClose", 0, [1, 2]], "has 1 fields"),
    ([1, "CloudClose", 0, ["x"]], "should be int"),
    ([1, "CloudClose", 0, []], "missing"),
    ([1, "FreeSequence", 0, [1, "s"]], "does not travel in compact form"),
    ([1, "Nope", 0, []], "unknown message type"),
])
def test_hostile_compact_headers_are_refused_clearly(header, error):
    import msgpack

    with pytest.raises(ProtocolError, match=error):
        decode([msgpack.packb(header)])


def test_a_compact_message_in_map_form_or_with_tensor_frames_is_refused():
    import msgpack

    from transport import wire

    frames = wire.encode_frames("CloudClose", {"session": 1}, [])
    with pytest.raises(ProtocolError, match="compact form only"):
        decode(frames)
    with pytest.raises(ProtocolError, match="no tensor frames"):
        decode([msgpack.packb([1, "CloudClose", 0, [1]]), b"\x00" * 4])


_COMPACT = [encode(m, call_id=3) for m in EXAMPLES if type(m).__name__.startswith("Cloud")]


@FAST
@given(which=st.integers(0, len(_COMPACT) - 1), pos=st.integers(0, 9), value=msgpack_values,
       inner=st.booleans(), delete=st.booleans())
def test_decoder_never_crashes_on_mutated_compact_headers(which, pos, value, inner, delete):
    h = msgpack.unpackb(_COMPACT[which][0], strict_map_key=False)
    target = h[3] if inner and isinstance(h[3], list) else h
    if delete and target:
        target.pop(pos % len(target))
    elif pos < len(target):
        target[pos] = value
    else:
        target.append(value)
    _assert_valid_or_protocol_error([msgpack.packb(h, use_bin_type=True)])


_FLAT_SAMPLING = ("temperature", "top_k", "top_p", "seed", "constraint", "penalties")


def test_a_stage_forwards_sampling_spec_travels_as_the_flat_fields_members_on_0_2_read():
    spec = SamplingSpec(SamplingParams(0.8, 40, 0.95, 7), Penalties(presence=0.5, repeat=1.2, repeat_last_n=16),
                        {"type": "json_object"})
    h = msgpack.unpackb(encode(S.StageForward("r", 1, "n/x/0", 0, sampling=spec))[0], strict_map_key=False)
    assert "sampling" not in h["fields"]
    assert {k: h["fields"][k] for k in _FLAT_SAMPLING} == {
        "temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7, "constraint": {"type": "json_object"},
        "penalties": {"presence": 0.5, "frequency": 0.0, "repeat": 1.2, "repeat_last_n": 16}}
    plain = msgpack.unpackb(encode(S.StageForward("r", 1, "n/x/0", 0))[0], strict_map_key=False)["fields"]
    assert (plain["constraint"], plain["penalties"]) == (None, None)  # inactive penalties: None, as 0.2 sends
    # ... and what a 0.2 member sends (the same flat fields, some left out) decodes into the spec.
    h["fields"] = {k: v for k, v in h["fields"].items() if k not in ("constraint", "seed")}
    got = decode([msgpack.packb(h, use_bin_type=True)]).message.sampling
    assert got == SamplingSpec(SamplingParams(0.8, 40, 0.95), spec.penalties)


@pytest.mark.parametrize("field, value", [
    ("penalties", {"presence": "lots"}), ("penalties", {"bogus": 1.0}), ("penalties", {"repeat_last_n": 1.5}),
    ("temperature", -1.0), ("top_p", 0.0), ("top_k", -3),
])
def test_hostile_sampling_fields_are_refused_when_decoded(field, value):
    h = msgpack.unpackb(encode(S.StageForward("r", 1, "n/x/0", 0))[0], strict_map_key=False)
    h["fields"][field] = value
    with pytest.raises(ProtocolError, match="invalid StageForward"):
        decode([msgpack.packb(h, use_bin_type=True)])
