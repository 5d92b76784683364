"""Wire format: tensors survive the trip bit for bit, without copies, and bad
frames become ProtocolError."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
import zmq

from transport import wire
from transport.errors import ProtocolError
from transport.messages import decode, encode
from transport.registry import message
from transport.stage_messages import StageForward
from transport.wire import DTYPES, REDUCED_PRECISION_ERROR, Limits


@message(name="TestWireProbe")
class Probe:
    """A test-only message with one tensor of each kind."""

    t: torch.Tensor | None = None
    n: np.ndarray | None = None
    note: str = ""


TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
                torch.int32, torch.int16, torch.int8, torch.uint8, torch.float64]
SHAPES = [(), (0,), (3, 0, 2), (1,), (5, 7), (2, 3, 4), (1 << 20,)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + 7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _roundtrip(msg):
    return decode(encode(msg)).message


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dtype_and_shape_round_trips_exactly(dtype, shape):
    t = _sample(dtype, shape)
    got = _roundtrip(Probe(t=t)).t
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got, t)


def test_bfloat16_payload_is_restored_bit_for_bit_including_nan_and_inf():
    patterns = [0x7FC0, 0xFF80, 0x7F80, 0x0001, 0x8000, 0x3F80, 0x7FBF]  # nan, -inf, inf, tiny, -0, 1, max
    bits = torch.from_numpy(np.array(patterns, dtype=np.uint16).view(np.int16))
    t = bits.view(torch.bfloat16)
    got = _roundtrip(Probe(t=t)).t
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), bits)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "bool", "uint8", "float64"])
def test_numpy_arrays_come_back_as_numpy_with_same_dtype(dtype):
    a = np.arange(24).reshape(2, 3, 4).astype(dtype)
    got = _roundtrip(Probe(n=a)).n
    assert isinstance(got, np.ndarray) and got.dtype == a.dtype
    np.testing.assert_array_equal(got, a)


def test_big_endian_numpy_input_is_sent_little_endian_and_restored():
    a = np.arange(6, dtype=">i4")
    got = _roundtrip(Probe(n=a)).n
    np.testing.assert_array_equal(got, a)


def test_non_contiguous_input_is_made_contiguous_once_and_counted():
    wire.stats.reset()
    t = torch.arange(12.0).reshape(3, 4).t()  # a transposed view
    assert not t.is_contiguous()
    got = _roundtrip(Probe(t=t)).t
    assert torch.equal(got, t)
    assert wire.stats.contiguous_copies == 1


def test_contiguous_tensor_is_sent_from_its_own_memory():
    t = torch.randn(256, 576)
    frames = encode(Probe(t=t))
    frame = frames[1]
    assert isinstance(frame, zmq.Frame)
    addr = np.frombuffer(frame.buffer, dtype=np.uint8).__array_interface__["data"][0]
    assert addr == t.data_ptr()


def test_small_tensors_are_copied_because_that_is_cheaper_than_zero_copy(monkeypatch):
    small = torch.randn(16)
    frame = encode(Probe(t=small))[1]
    addr = np.frombuffer(frame.buffer, dtype=np.uint8).__array_interface__["data"][0]
    assert addr != small.data_ptr()
    monkeypatch.setattr(wire, "ZERO_COPY_MIN_BYTES", 0)
    frame = encode(Probe(t=small))[1]
    assert np.frombuffer(frame.buffer, dtype=np.uint8).__array_interface__["data"][0] == small.data_ptr()


def _frame_range(frame: zmq.Frame) -> tuple[int, int]:
    start = np.frombuffer(frame.buffer, dtype=np.uint8).__array_interface__["data"][0]
    return start, start + len(frame)


def test_received_tensor_lies_inside_the_received_frame_buffer_over_tcp():
    """The receive path does not copy: the tensor's memory is the frame's memory."""
    ctx = zmq.Context()
    try:
        rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        port = rx.bind_to_random_port("tcp://127.0.0.1")
        tx.connect(f"tcp://127.0.0.1:{port}")
        hidden = torch.randn(64, 576)
        tx.send_multipart(encode(StageForward("r", 1, "s0", 0, hidden=hidden)), copy=False)
        assert rx.poll(5000)
        frames = rx.recv_multipart(copy=False)
        got = decode(frames).message.hidden
        start, end = _frame_range(frames[1])
        assert start <= got.data_ptr() and got.data_ptr() + got.nbytes <= end
        assert torch.equal(got, hidden)
        # numpy results too
        arr = np.arange(100_000, dtype=np.int64)
        tx.send_multipart(encode(Probe(n=arr)), copy=False)
        assert rx.poll(5000)
        frames = rx.recv_multipart(copy=False)
        got_n = decode(frames).message.n
        start, end = _frame_range(frames[1])
        assert start <= got_n.__array_interface__["data"][0] < end
    finally:
        ctx.destroy(linger=0)


def test_inproc_delivery_shares_the_senders_memory_end_to_end():
    """Over inproc ZeroMQ hands the buffer across: no copy on either side."""
    ctx = zmq.Context()
    try:
        rx, tx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        rx.bind("inproc://zc")
        tx.connect("inproc://zc")
        t = torch.randn(1024, 64)
        tx.send_multipart(encode(Probe(t=t)), copy=False)
        got = decode(rx.recv_multipart(copy=False)).message.t
        assert got.data_ptr() == t.data_ptr()
    finally:
        ctx.destroy(linger=0)


def test_received_tensor_keeps_its_frame_alive():
    frames = [zmq.Frame(f.bytes if isinstance(f, zmq.Frame) else f) for f in encode(Probe(t=torch.arange(1000.0)))]
    got = decode(frames).message.t
    del frames
    import gc

    gc.collect()
    assert torch.equal(got, torch.arange(1000.0))


def test_bytes_frames_decode_without_warnings(recwarn):
    frames = [f.bytes if isinstance(f, zmq.Frame) else f for f in encode(Probe(t=torch.arange(10.0)))]
    got = decode(frames).message.t
    assert torch.equal(got, torch.arange(10.0))
    assert not [w for w in recwarn if "writable" in str(w.message)]


# ---------------------------------------------------------- reduced precision


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_reduced_precision_activations_halve_bytes_and_stay_within_stated_error(wire_dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 576, generator=g) * 4
    msg = StageForward("r", 1, "s0", 0, hidden=hidden)
    full = encode(msg)
    reduced = encode(msg, activation_dtype=wire_dtype)
    assert len(reduced[1]) * 2 == len(full[1])
    got = decode(reduced).message.hidden
    assert got.dtype == torch.float32 and got.shape == hidden.shape
    bound = REDUCED_PRECISION_ERROR[wire_dtype]["max_rel_error"]
    normal = hidden.abs() >= 6.2e-5
    rel = ((got - hidden).abs() / hidden.abs())[normal]
    assert rel.max().item() <= bound
    if wire_dtype == "float16":
        sub_bound = REDUCED_PRECISION_ERROR["float16"]["max_abs_error_subnormal"]
        assert ((got - hidden).abs()[~normal] <= sub_bound).all()


def test_float16_activation_that_would_overflow_is_sent_as_float32():
    wire.stats.reset()
    hidden = torch.tensor([[1.0, 70000.0]])
    frames = encode(StageForward("r", 1, "s0", 0, hidden=hidden), activation_dtype="float16")
    assert len(frames[1]) == hidden.nbytes
    assert torch.equal(decode(frames).message.hidden, hidden)
    assert wire.stats.reduced_precision_fallbacks == 1


def test_only_activation_fields_are_reduced():
    ids = torch.tensor([1, 2, 3])
    mask = torch.ones(3, 3, dtype=torch.bool)
    frames = encode(StageForward("r", 1, "s0", 0, token_ids=ids, tree_mask=mask), activation_dtype="float16")
    got = decode(frames).message
    assert torch.equal(got.token_ids, ids) and torch.equal(got.tree_mask, mask)


def test_unknown_activation_dtype_is_refused():
    with pytest.raises(ProtocolError, match="activation dtype"):
        encode(StageForward("r", 1, "s0", 0, hidden=torch.zeros(2)), activation_dtype="int8")


# ---------------------------------------------------------- malformed input


def _header(frames) -> dict:
    return msgpack.unpackb(frames[0], strict_map_key=False)


def _with_header(frames, **changes) -> list:
    h = _header(frames)
    h.update(changes)
    return [msgpack.packb(h), *frames[1:]]


def _probe_frames():
    return encode(Probe(t=torch.arange(6, dtype=torch.float32).reshape(2, 3)), call_id=42)


def test_unknown_message_type_is_a_protocol_error_carrying_the_call_id():
    with pytest.raises(ProtocolError, match="unknown message type 'Nope'") as e:
        decode(_with_header(_probe_frames(), type="Nope"))
    assert e.value.call_id == 42


def test_wrong_protocol_version_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="unsupported protocol version 99"):
        decode(_with_header(_probe_frames(), version=99))


def test_missing_tensor_frame_is_a_protocol_error():
    frames = _probe_frames()
    with pytest.raises(ProtocolError, match="describes 1 tensor.* but 0 tensor frame"):
        decode(frames[:1])


def test_extra_frame_is_a_protocol_error():
    frames = _probe_frames()
    with pytest.raises(ProtocolError, match="describes 1 tensor.* but 2 tensor frame"):
        decode([*frames, b"xx"])


def test_byte_length_that_does_not_match_dtype_times_shape_is_a_protocol_error():
    frames = _probe_frames()
    h = _header(frames)
    h["tensors"][0]["nbytes"] = 20
    with pytest.raises(ProtocolError, match=r"nbytes 20 does not match float32 x \(2, 3\) = 24"):
        decode([msgpack.packb(h), frames[1]])


def test_frame_shorter_than_header_says_is_a_protocol_error():
    frames = _probe_frames()
    with pytest.raises(ProtocolError, match="frame 1 holds 8 bytes, header says 24"):
        decode([frames[0], b"12345678"])


def test_dtype_outside_the_allow_list_is_a_protocol_error():
    frames = _probe_frames()
    h = _header(frames)
    h["tensors"][0]["dtype"] = "complex64"
    with pytest.raises(ProtocolError, match="dtype 'complex64' is not allowed"):
        decode([msgpack.packb(h), frames[1]])
    with pytest.raises(ProtocolError, match="not allowed on the wire"):
        encode(Probe(t=torch.zeros(2, dtype=torch.complex64)))


def test_oversize_messages_are_refused_by_the_configured_limits():
    frames = encode(Probe(t=torch.zeros(1000)))
    with pytest.raises(ProtocolError, match="exceeds the tensor limit 1000"):
        decode(frames, limits=Limits(max_tensor_bytes=1000))
    with pytest.raises(ProtocolError, match="limit is 2000"):
        decode(frames, limits=Limits(max_total_bytes=2000))
    with pytest.raises(ProtocolError, match="header is .* bytes, limit is 10"):
        decode(frames, limits=Limits(max_header_bytes=10))
    with pytest.raises(ProtocolError, match="2 frames, limit is 1"):
        decode(frames, limits=Limits(max_frames=1))


def test_bool_tensor_with_non_boolean_bytes_is_a_protocol_error():
    frames = encode(Probe(t=torch.tensor([True, False])))
    with pytest.raises(ProtocolError, match="bytes other than 0 and 1"):
        decode([frames[0], b"\x01\x07"])


def test_field_of_the_wrong_type_is_a_protocol_error():
    frames = encode(StageForward("r", 1, "n/x/0", 0))
    h = _header(frames)
    h["fields"]["position_offset"] = "seven"
    with pytest.raises(ProtocolError, match="StageForward.position_offset should be int, got str"):
        decode([msgpack.packb(h)])


def test_garbage_header_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([b"\xc1\xc1\xc1"])
    with pytest.raises(ProtocolError, match="a compact header has 4 entries"):
        decode([msgpack.packb([1, 2, 3])])
    with pytest.raises(ProtocolError, match="header must be a map"):
        decode([msgpack.packb("text")])
    with pytest.raises(ProtocolError, match="empty message"):
        decode([])


def test_stated_error_bounds_match_the_formats():
    # Round-to-nearest: at most half the machine epsilon, relative.
    assert math.isclose(REDUCED_PRECISION_ERROR["float16"]["max_rel_error"], torch.finfo(torch.float16).eps / 2)
    assert math.isclose(REDUCED_PRECISION_ERROR["bfloat16"]["max_rel_error"], torch.finfo(torch.bfloat16).eps / 2)
    assert set(DTYPES) >= {"float32", "float16", "bfloat16", "int64", "bool"}


def test_an_oversized_header_is_refused_with_its_call_id_so_the_sender_fails_at_once():
    small = Limits(max_header_bytes=1024)
    big_map = encode(StageForward("r" * 4000, 1, "n/x/0", 0), call_id=4242)
    with pytest.raises(ProtocolError) as err:
        decode(big_map, limits=small)
    assert err.value.call_id == 4242
    big_array = [msgpack.packb([1, "CloudClose", 77, [b"\x00" * 4000]])]
    with pytest.raises(ProtocolError) as err:
        decode(big_array, limits=small)
    assert err.value.call_id == 77
