"""ROUTER/DEALER links: replies matched by request id, timeouts, cancellation,
errors carried back, malformed input refused without stopping the server."""

from __future__ import annotations

import asyncio
import random

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from transport import loop as transport_loop
from transport.errors import ProtocolError, RemoteError, TransportClosed, TransportTimeout
from transport.link import StageServer
from transport.peer import Peer
from transport.messages import Ack, ErrorReply, LinkProbe, encode
from transport.stage_messages import FreeSequence, StageForward, TokenResult, Truncate
from transport.wire import Limits
from tests.support.logs import all_log_events
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


class Recorder:
    """A handler that echoes StageForward as a TokenResult and records calls."""

    def __init__(self, delay=lambda: 0.0):
        self.calls = []
        self.delay = delay

    async def __call__(self, msg, req):
        self.calls.append((msg, req))
        d = self.delay()
        if d:
            await asyncio.sleep(d)  # sleep-ok: a handler taking a little while, so replies overtake each other
        if isinstance(msg, StageForward):
            ids = msg.token_ids if msg.token_ids is not None else torch.tensor([int(msg.seq_id[1:])])
            return TokenResult(msg.request_id, msg.plan_version, msg.seq_id, ids)
        if isinstance(msg, Truncate):
            raise ValueError(f"cannot truncate seq {msg.seq_id}")
        return None


async def _pair(ctx, handler, *, server_kw=None, peer_kw=None):
    server = StageServer(handler, node_id="stage-1", context=ctx, **(server_kw or {}))
    addr = await server.start("tcp://127.0.0.1:0")
    peer = Peer(node_id="client", context=ctx, timeout=5.0, **(peer_kw or {}))
    await peer.connect(addr)
    return server, peer


def _fwd(i: int, **kw) -> StageForward:
    return StageForward(f"req-{i}", 3, f"s{i}", 0, token_ids=torch.tensor([i, i + 1]), **kw)


async def test_request_gets_the_handlers_reply(ctx):
    h = Recorder()
    server, peer = await _pair(ctx, h)
    try:
        hidden = torch.randn(64, 576)
        reply = await peer.request(_fwd(7, hidden=hidden))
        assert isinstance(reply, TokenResult)
        assert reply.request_id == "req-7" and torch.equal(reply.token_ids, torch.tensor([7, 8]))
        msg, req = h.calls[0]
        assert torch.equal(msg.hidden, hidden)
        assert req.sender == "client" and req.peer_key == "" and not req.one_way
    finally:
        await peer.close()
        await server.close()


async def test_many_concurrent_requests_on_one_link_get_their_own_replies(ctx):
    rng = random.Random(1)
    server, peer = await _pair(ctx, Recorder(delay=lambda: rng.random() * 0.01))
    try:
        n = 300
        replies = await asyncio.gather(*(peer.request(_fwd(i)) for i in range(n)))
        assert [r.request_id for r in replies] == [f"req-{i}" for i in range(n)]
        assert all(torch.equal(r.token_ids, torch.tensor([i, i + 1])) for i, r in enumerate(replies))
        assert peer.in_flight == 0
    finally:
        await peer.close()
        await server.close()


async def test_handler_returning_none_replies_ack(ctx):
    server, peer = await _pair(ctx, Recorder())
    try:
        assert isinstance(await peer.request(FreeSequence(3, f"s{9}")), Ack)
    finally:
        await peer.close()
        await server.close()


async def test_handler_exception_comes_back_as_remote_error_and_server_keeps_serving(ctx):
    server, peer = await _pair(ctx, Recorder())
    try:
        with pytest.raises(RemoteError, match="cannot truncate seq s4") as e:
            await peer.request(Truncate(3, "s4", 10))
        assert e.value.code == "handler"
        assert (await peer.request(_fwd(1))).request_id == "req-1"
        assert server.stats["handler_errors"] == 1
    finally:
        await peer.close()
        await server.close()


async def test_timeout_raises_transport_timeout_and_forgets_the_request(ctx):
    answer_late = asyncio.Event()

    async def handler(msg, req):
        if msg.seq_id == "s1":
            await answer_late.wait()  # answers only after the caller gave up
        return None

    server, peer = await _pair(ctx, handler)
    try:
        with all_log_events() as logs:
            with pytest.raises(TransportTimeout, match="no reply to FreeSequence"):
                await peer.request(FreeSequence(1, f"s{1}"), timeout=0.05)
            assert peer.in_flight == 0
            answer_late.set()
            await eventually(lambda: any(e["event"] == "late_reply_dropped" for e in logs), 10,
                             "the late reply to arrive and be dropped quietly")
        assert isinstance(await peer.request(FreeSequence(1, f"s{2}")), Ack)
    finally:
        await peer.close()
        await server.close()


async def test_cancelled_request_removes_its_pending_future(ctx):
    started = asyncio.Event()

    async def handler(msg, req):
        started.set()
        await asyncio.Event().wait()  # never answers

    server, peer = await _pair(ctx, handler)
    try:
        task = asyncio.create_task(peer.request(FreeSequence(1, f"s{1}")))
        await asyncio.wait_for(started.wait(), 5)
        assert peer.in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert peer.in_flight == 0
    finally:
        await peer.close()
        await server.close()


async def test_close_fails_pending_requests_with_transport_closed(ctx):
    started = asyncio.Event()

    async def handler(msg, req):
        started.set()
        await asyncio.Event().wait()  # never answers

    server, peer = await _pair(ctx, handler)
    try:
        task = asyncio.create_task(peer.request(FreeSequence(1, f"s{1}")))
        await asyncio.wait_for(started.wait(), 5)
        await peer.close()
        with pytest.raises(TransportClosed):
            await task
        with pytest.raises(TransportClosed):
            await peer.request(FreeSequence(1, f"s{1}"))
    finally:
        await peer.close()
        await server.close()


async def test_request_to_nobody_times_out(ctx):
    peer = Peer(context=ctx)
    await peer.connect("tcp://127.0.0.1:9")  # discard port: nothing listens
    try:
        with pytest.raises(TransportTimeout):
            await peer.request(FreeSequence(1, f"s{1}"), timeout=0.1)
        assert peer.in_flight == 0
    finally:
        await peer.close()


async def test_one_way_send_reaches_the_handler_without_a_reply(ctx):
    h = Recorder()
    seen = []
    server, peer = await _pair(ctx, h, peer_kw={"on_message": seen.append})
    try:
        for i in range(5):
            await peer.send(_fwd(i))
        await eventually(lambda: len(h.calls) == 5, 10, "the five one-way messages handled")
        assert [m.seq_id for m, _ in h.calls] == [f"s{i}" for i in range(5)]
        assert all(r.one_way for _, r in h.calls)
        # A round trip after them: a reply to any of the five would have reached us before its Ack.
        assert isinstance(await peer.request(FreeSequence(1, "s9")), Ack)
        assert seen == [] and server.stats["replied"] == 1
    finally:
        await peer.close()
        await server.close()


async def test_failing_one_way_message_still_reports_an_error_to_the_sender(ctx):
    seen = []
    server, peer = await _pair(ctx, Recorder(), peer_kw={"on_message": seen.append})
    try:
        with all_log_events() as logs:
            await peer.send(Truncate(1, "s2", 3))
            await eventually(lambda: seen, 10, "the error reply to the one-way message")
        assert isinstance(seen[0].message, ErrorReply) and seen[0].message.code == "handler"
        assert any(e["event"] == "remote_error" for e in logs)
    finally:
        await peer.close()
        await server.close()


async def test_ordered_server_handles_one_message_at_a_time_in_arrival_order(ctx):
    active, order, peak = [0], [], [0]

    async def handler(msg, req):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await asyncio.sleep(0.001)  # sleep-ok: lets another handler interleave, were the server not ordered
        order.append(msg.seq_id)
        active[0] -= 1

    server, peer = await _pair(ctx, handler, server_kw={"ordered": True})
    try:
        await asyncio.gather(*(peer.request(FreeSequence(1, f"s{i}")) for i in range(20)))
        assert order == [f"s{i}" for i in range(20)] and peak[0] == 1
    finally:
        await peer.close()
        await server.close()


async def test_urgent_messages_overtake_the_ordered_queue_which_keeps_its_order(ctx):
    """A free must not wait behind the chunks it cancels (each may take seconds to compute)."""
    order, computing, gate = [], [], asyncio.Event()

    async def handler(msg, req):
        if isinstance(msg, StageForward):
            computing.append(msg.seq_id)
            await gate.wait()  # a long forward
        order.append(msg.seq_id)

    server, peer = await _pair(ctx, handler, server_kw={
        "ordered": True, "urgent": lambda m: isinstance(m, FreeSequence)})
    try:
        chunks = [asyncio.create_task(peer.request(_fwd(i))) for i in range(3)]
        await eventually(lambda: computing == ["s0"], 10, "s0 computing, s1 and s2 queued behind it")
        await asyncio.wait_for(peer.request(FreeSequence(1, "s9")), 5)  # handled while s0 computes
        assert order == ["s9"]
        gate.set()
        await asyncio.gather(*chunks)
        assert order == ["s9", "s0", "s1", "s2"]
    finally:
        await peer.close()
        await server.close()


async def test_a_lane_takes_everything_queued_behind_a_running_message_and_answers_each(ctx):
    """A stage takes the work that queued while it computed from the inbox: arrival order, one reply each."""
    calls, gate = [], asyncio.Event()

    async def handler(msg, req):  # the urgent messages only: the lane takes the rest
        return None

    async def step(msgs):
        calls.append([m.seq_id for m in msgs])
        if len(calls) == 1:
            await gate.wait()  # a long forward while more arrive
        return [ErrorReply("bad", "s2 is bad") if m.seq_id == "s2" else None for m in msgs]

    async def lane(server):  # everything queued at once
        while True:
            reqs = [await server.inbox.get()]
            while not server.inbox.empty():
                reqs.append(server.inbox.get_nowait())
            await server.answer(reqs, step)

    server, peer = await _pair(ctx, handler, server_kw={
        "ordered": True, "urgent": lambda m: isinstance(m, FreeSequence), "lane": lane})
    try:
        first = asyncio.create_task(peer.request(_fwd(0)))
        await eventually(lambda: calls == [["s0"]], 5, "s0's step running")
        rest = [asyncio.create_task(peer.request(_fwd(i))) for i in range(1, 4)]
        await eventually(lambda: server.inbox.qsize() == 3, 5, "s1..s3 queued behind it")
        gate.set()
        replies = await asyncio.gather(first, *rest, return_exceptions=True)
        assert calls == [["s0"], ["s1", "s2", "s3"]]
        assert [type(r).__name__ for r in replies] == ["Ack", "Ack", "RemoteError", "Ack"]
    finally:
        await peer.close()
        await server.close()


async def test_a_failing_step_answers_every_message_with_the_error(ctx):
    async def step(msgs):
        raise RuntimeError("the model broke")

    async def lane(server):
        while True:
            await server.answer([await server.inbox.get()], step)

    server, peer = await _pair(ctx, lambda m, r: None, server_kw={
        "ordered": True, "urgent": lambda m: isinstance(m, FreeSequence), "lane": lane})
    try:
        with pytest.raises(RemoteError, match="the model broke"):
            await asyncio.wait_for(peer.request(_fwd(0)), 5)
        assert server.stats["handler_errors"] == 1
    finally:
        await peer.close()
        await server.close()


# ------------------------------------------------------------ malformed input


async def _raw_dealer(ctx, addr):
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(addr)
    return d


async def _recv_error(d) -> ErrorReply:
    from transport.messages import decode

    frames = await asyncio.wait_for(d.recv_multipart(copy=False), 5)
    env = decode(frames)
    assert isinstance(env.message, ErrorReply)
    return env


@pytest.mark.parametrize(
    "frames, expected",
    [
        ([b"\xc1garbage"], "not valid msgpack"),
        ([msgpack.packb({"version": 1, "type": "Nope", "request_id": 11})], "unknown message type 'Nope'"),
        ([msgpack.packb({"version": 9, "type": "Ack", "request_id": 11})], "unsupported protocol version 9"),
        ([b"", b"", b""], "not valid msgpack"),
    ],
    ids=["garbage", "unknown-type", "wrong-version", "empty-frames"],
)
async def test_malformed_message_gets_an_error_reply_and_never_reaches_the_handler(ctx, frames, expected):
    h = Recorder()
    server, peer = await _pair(ctx, h)
    d = await _raw_dealer(ctx, server.address)
    try:
        await d.send_multipart(frames)
        env = await _recv_error(d)
        assert env.message.code == "protocol" and expected in env.message.message
        if b"Nope" in frames[0] or b"\x09" in frames[0]:
            assert env.call_id == 11  # recovered so the sender can match it
        assert h.calls == []
        assert (await peer.request(_fwd(1))).request_id == "req-1"  # still serving
    finally:
        d.close(linger=0)
        await peer.close()
        await server.close()


async def test_header_frame_count_mismatch_is_refused_with_error_reply(ctx):
    h = Recorder()
    server, peer = await _pair(ctx, h)
    d = await _raw_dealer(ctx, server.address)
    try:
        frames = encode(_fwd(1, hidden=torch.zeros(4, 4)), call_id=5)
        await d.send_multipart(frames[:1])
        env = await _recv_error(d)
        assert env.call_id == 5 and "tensor frame" in env.message.message
        assert h.calls == []
    finally:
        d.close(linger=0)
        await peer.close()
        await server.close()


async def test_oversize_message_is_refused_with_a_clear_remote_error(ctx):
    h = Recorder()
    server, peer = await _pair(ctx, h, server_kw={"limits": Limits(max_tensor_bytes=1024)})
    try:
        with pytest.raises(RemoteError, match="exceeds the tensor limit 1024") as e:
            await peer.request(_fwd(1, hidden=torch.zeros(64, 576)))
        assert e.value.code == "protocol" and h.calls == []
        assert (await peer.request(_fwd(2, hidden=torch.zeros(4)))).request_id == "req-2"
    finally:
        await peer.close()
        await server.close()


async def test_malformed_reply_fails_the_matching_request_with_protocol_error(ctx):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peer = Peer(context=ctx, timeout=5)
    await peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        task = asyncio.create_task(peer.request(FreeSequence(1, f"s{1}")))
        ident, header = await asyncio.wait_for(router.recv_multipart(), 5)
        rid = msgpack.unpackb(header)["request_id"]
        bad = msgpack.packb({"version": 1, "type": "Ack", "request_id": rid, "fields": {"detail": 5}})
        await router.send_multipart([ident, bad])
        with pytest.raises(ProtocolError, match="Ack.detail should be str"):
            await task
    finally:
        await peer.close()
        router.close(linger=0)


# ------------------------------------------------------------ event loops


def test_round_trip_runs_on_uvloop_when_available():
    async def main():
        c = zmq.asyncio.Context()
        try:
            server, peer = await _pair(c, Recorder())
            try:
                loop_name = type(asyncio.get_running_loop()).__module__
                reply = await peer.request(_fwd(3, hidden=torch.randn(8, 8)))
                return loop_name, reply
            finally:
                await peer.close()
                await server.close()
        finally:
            c.destroy(linger=0)

    loop_name, reply = transport_loop.run(main())
    assert reply.request_id == "req-3"
    if transport_loop.HAVE_UVLOOP:
        assert loop_name.startswith("uvloop")


async def test_heartbeat_fields_survive_the_link(ctx):
    h = Recorder()
    server, peer = await _pair(ctx, h)
    try:
        await peer.request(LinkProbe("n1", "serving", 0.25, 4, 1700000000.5))
        assert h.calls[0][0] == LinkProbe("n1", "serving", 0.25, 4, 1700000000.5)
    finally:
        await peer.close()
        await server.close()


async def test_a_send_waiting_on_a_link_that_gets_closed_fails_as_a_closed_link_not_a_cancellation(ctx):
    """Re-dialling a member that moved closes the old link under sends still queued to it."""
    peer = Peer(node_id="client", context=ctx, timeout=5.0, hwm=1)
    await peer.connect("tcp://127.0.0.1:1")  # nobody listens: sends wait for a connection
    try:
        sending = asyncio.create_task(peer.send(FreeSequence(1, "s1"), timeout=30))
        # The send's first step runs at once (event-loop order, not time); with nobody listening it
        # then waits for good, so this only bounds how long the check takes.
        done, _ = await asyncio.wait({sending}, timeout=0.1)
        assert not done, "with nobody listening the send should wait"
        await peer.close()
        with pytest.raises(TransportClosed):
            await asyncio.wait_for(sending, 5)
    finally:
        await peer.close()
