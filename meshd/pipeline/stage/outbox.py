"""Where a stage's results and failures go: the next stage, or the coordinator that asked.

Its own module because it is the stage's only outward traffic besides replies
to the sender: a pass's activations travel on to the next stage of the route, a
last stage's tokens and every failure go to the coordinator named in the
message (``reply_to``), and an error reply is shaped for what that coordinator
decodes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from decoding.models import StageModel
from meshd.log import get_logger
from meshd.mesh.caps import Cap, PeerCaps
from meshd.pipeline.links import Directory, Links
from meshd.pipeline.route import Route
from meshd.pipeline.seqkey import coordinator_of
from meshd.pipeline.stage.errors import HopUnreachable, error_code, failed_node
from meshd.pipeline.stage.stats import StageStats
from partition.ids import NodeId
from transport.errors import TransportError
from transport.messages import ErrorReply
from transport.node import TransportNode
from transport.stage_messages import StageForward

log = get_logger("meshd.stage")

__all__ = ["StageOutbox"]


class StageOutbox:
    def __init__(self, node: TransportNode, node_id: NodeId, directory: Directory, stats: StageStats,
                 activation_dtype: str | None = None, send_timeout_s: float = 5.0,
                 peer_caps: Callable[[NodeId], PeerCaps] | None = None):
        """``activation_dtype``: hidden states travel at this precision ("float16"/"bfloat16"; None: as
        computed); ``peer_caps``: see :class:`~meshd.pipeline.stage.service.StageService`."""
        self.node_id = node_id
        self.stats = stats
        self.activation_dtype = activation_dtype
        self.send_timeout_s = send_timeout_s
        self.links = Links(node, directory)
        self._peer_caps = peer_caps

    async def close(self) -> None:
        await self.links.close()

    async def forward(self, route: Route, index: int, msg: StageForward, stage: StageModel, out: Any,
                      want_logits: bool) -> None:
        """A pass's result for ``msg``: activations on to the next stage, or a last stage's answer back."""
        if not stage.is_last:
            # Everything travels on (sampling, verify tree, commit, shaping, the token ids every stage's
            # prefix cache keys on); only the payload changes: our activations.
            nxt = dataclasses.replace(msg, hidden=out)
            to = await self.send_next(route, index, nxt)
            elem = 2 if self.activation_dtype in ("float16", "bfloat16") else out.element_size()
            self.stats.count_sent(to, out.numel() * elem)
        elif want_logits and out is not None:
            await self.report(msg.reply_to, out)

    async def pass_on(self, route: Route, index: int, msg) -> None:
        """A control message every later stage applies too (none after the last)."""
        if route.next_after(index) is not None:
            await self.send_next(route, index, msg)

    async def send_next(self, route: Route, index: int, msg) -> NodeId:
        """Send ``msg`` to the next stage; returns its node id (``HopUnreachable`` names it when that fails)."""
        nxt = route.next_after(index)
        try:
            peer = await self.links.to(nxt.node_id)
            await peer.send(msg, timeout=self.send_timeout_s, activation_dtype=self.activation_dtype)
        except TransportError as exc:
            raise HopUnreachable(nxt.node_id, exc) from exc
        return nxt.node_id

    async def report(self, reply_to: str, msg) -> None:
        """Send to a coordinator; ``reply_to`` is "node_id|address" (its key comes from the directory)."""
        node_id, _, address = reply_to.partition("|")
        try:
            peer = await self.links.to(node_id, address)
            await peer.send(msg, timeout=self.send_timeout_s)
        except (TransportError, KeyError) as exc:
            log.warning("report_failed", to=reply_to, error=str(exc), message_type=type(msg).__name__)

    def error_reply(self, msg: Any, exc: Exception) -> ErrorReply:
        """The one error reply for ``msg`` failing with ``exc`` (logged), naming this node or the one that failed."""
        code = error_code(exc)
        rid = getattr(msg, "request_id", "")
        seq = getattr(msg, "seq_id", None)
        text = str(exc) if code != "internal" else f"{type(exc).__name__}: {exc}"
        failed = failed_node(exc, self.node_id)
        log.warning("stage_error", code=code, error=text, request_id=rid, seq=seq, failed_node=failed,
                    message_type=type(msg).__name__, exc_info=code == "internal")
        reply_to = getattr(msg, "reply_to", "")
        told = reply_to.partition("|")[0] if reply_to else coordinator_of(seq) if isinstance(seq, str) else ""
        new = self.reads(told, Cap.ERROR_NODE)
        return ErrorReply(code, f"{self.node_id}: {text}", rid if isinstance(rid, str) else "",
                          node=failed if new else "", seq_id=seq if new and isinstance(seq, str) else "")

    def reads(self, node_id: NodeId, cap: Cap) -> bool:
        """Whether ``node_id``'s daemon has ``cap`` (say, accepts ``ErrorReply.node``: a coordinator
        without that capability refuses the whole reply, its ErrorReply being strict)."""
        if self._peer_caps is None or node_id == self.node_id:
            return True
        return bool(node_id) and cap in self._peer_caps(node_id)
