"""A stage's errors name the node that failed, to coordinators that decode it, on 0.2's wire otherwise."""

from __future__ import annotations

import msgpack
import pytest

from meshd.pipeline.stage import StageService
from meshd.mesh.caps import OURS, PeerCaps
from meshd.pipeline.stage.errors import HopUnreachable, error_code, failed_node
from transport.errors import TransportTimeout
from transport.messages import ErrorReply, decode, encode
from transport.stage_messages import StageForward


def test_error_reply_carries_the_node_and_a_reply_without_one_is_what_0_2_sends():
    assert decode(encode(ErrorReply("link", "dev0: gone", "r1", node="dev1"))).message.node == "dev1"
    fields = msgpack.unpackb(encode(ErrorReply("stale_plan", "dev0: old plan"))[0])["fields"]
    assert fields == {"code": "stale_plan", "message": "dev0: old plan"}  # 0.2 decodes it as before
    old = msgpack.unpackb(encode(ErrorReply("cache_full", "dev0: full", "r2"))[0])
    assert decode([msgpack.packb(old)]).message == ErrorReply("cache_full", "dev0: full", "r2", node="")


def test_an_unreachable_next_hop_is_the_failed_node():
    hop = HopUnreachable("dev1", TransportTimeout("could not queue StageForward"))
    assert error_code(hop) == "link" and str(hop) == "could not queue StageForward"
    assert failed_node(hop, "dev0") == "dev1" and failed_node(ValueError("x"), "dev0") == "dev0"


class NoNode:  # the stage never sends or serves in these tests
    pass


@pytest.mark.parametrize("coordinator_caps,node", [(None, "dev0"), (PeerCaps(), ""), (OURS, "dev0")])
async def test_a_stage_names_itself_when_it_fails_unless_the_coordinator_lacks_the_capability(coordinator_caps,
                                                                                             node):
    caps = None if coordinator_caps is None else (lambda _: coordinator_caps)
    svc = StageService(NoNode(), "dev0", object(), lambda n: ("", ""), peer_caps=caps)
    try:
        reply = await svc.handle(StageForward(request_id="r", plan_version=1, seq_id="coord/ab/1",
                                              position_offset=0), None)
    finally:
        await svc.close()
    assert isinstance(reply, ErrorReply) and reply.code == "no_stage"
    assert reply.message.startswith("dev0: ") and reply.node == node
