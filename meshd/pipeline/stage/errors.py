"""What a stage's failures are called on the wire, and which node failed.

Every failure a stage reports becomes one ``ErrorReply`` whose ``code`` tells
the coordinator what to do next (replay, back off, give up) and whose ``node``
says which device failed: the stage itself, or the next stage it could not
reach. The coordinator suspects that device instead of parsing error text.
"""

from __future__ import annotations

from decoding.errors import CacheFull
from decoding.tensor_group import GroupLost
from meshd.errors import USER_ERRORS, MeshdError
from partition.ids import NodeId
from transport.errors import TransportError

__all__ = ["StageError", "HopUnreachable", "error_code", "failed_node"]


class StageError(MeshdError):
    """A message this stage will not run; ``code`` travels in the ``ErrorReply``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class HopUnreachable(StageError):
    """The next stage could not be sent to: that node failed, not this one."""

    def __init__(self, node: NodeId, cause: TransportError):
        super().__init__("link", str(cause))
        self.node = node


def error_code(exc: BaseException) -> str:
    if isinstance(exc, CacheFull):
        return "cache_full"
    if isinstance(exc, StageError):
        return exc.code
    if isinstance(exc, (TransportError, GroupLost)):  # a tensor group's member or link went away
        return "link"
    if isinstance(exc, USER_ERRORS):  # also decoding's (a bad cache op, a context overflow)
        return "stage"
    return "internal"


def failed_node(exc: BaseException, own: NodeId) -> NodeId:
    """The node a failure belongs to: the unreachable next hop, else this stage."""
    return exc.node if isinstance(exc, HopUnreachable) else own
