"""What can go wrong with a request in the pipeline, and which device it is blamed on.

A stage's ``ErrorReply`` carries the failed node as a field, set for every coordinator
whose heartbeats announce the ``error_node`` capability (``meshd.mesh.caps``: every daemon
of this tree); a stage of an older release only writes it at the head of the message, so
:func:`legacy_failed_node` reads it from there, and nowhere else parses text.
"""

from __future__ import annotations

from meshd.errors import MeshdError
from meshd.pipeline.route import Route
from transport.messages import ErrorReply

__all__ = ["BadTokens", "Interrupted", "ModelMismatch", "NoRoute", "PipelineBusy", "PipelineError", "PrefixMiss",
           "RESUMABLE_CODES", "failed_node", "gone_message", "legacy_failed_node", "reply_error"]

# Stage error codes that mean "this sequence's cache is gone, the request itself is fine":
# replay it (possibly on a new plan) instead of failing the client.
RESUMABLE_CODES = frozenset({"no_stage", "stale_plan", "unknown_sequence", "position_mismatch", "link",
                             "protocol"})


class PipelineError(MeshdError):
    """A request could not be completed by the pipeline (the message says where and why)."""


class NoRoute(PipelineError):
    pass


class ModelMismatch(PipelineError):
    """This device holds another model than the plan's: it cannot coordinate the home's requests."""


class BadTokens(PipelineError):
    """A prompt holds token ids outside the model's vocabulary (never sent to a stage)."""


class PipelineBusy(PipelineError):
    """A stage has no room for the request now (KV cache full): retry shortly."""

    retry_after_s = 2.0


class Interrupted(Exception):
    """The request's current sequence is lost; replay it (``device``: who we suspect, if anyone)."""

    def __init__(self, why: str, device: str | None = None):
        super().__init__(why)
        self.device = device


class PrefixMiss(Interrupted):
    """A stage no longer holds the cached prefix the request was to reuse: prefill it in full."""


def legacy_failed_node(message: str) -> str:
    """The node an older stage names at the head of its error text ("node: what happened")."""
    return message.split(":", 1)[0]


def failed_node(reply: ErrorReply) -> str:
    """The device a stage's error is blamed on: its ``node`` field, else (an older stage) its text."""
    return reply.node or legacy_failed_node(reply.message)


def reply_error(reply: ErrorReply) -> Exception:
    """What a stage's ``ErrorReply`` means for the request: replay it, back off, or fail."""
    if reply.code == "cache_full":
        return PipelineBusy(f"the mesh is busy: {reply.message}; retry shortly")
    if reply.code == "prefix_miss":
        return PrefixMiss(f"stage {reply.message}", failed_node(reply))
    if reply.code == "model_mismatch":
        return ModelMismatch(f"stage {reply.message}")
    if reply.code in RESUMABLE_CODES:
        return Interrupted(f"stage failed ({reply.code}): {reply.message}", failed_node(reply))
    return PipelineError(f"stage failed ({reply.code}): {reply.message}")


def gone_message(route: Route, now: Route | None, exc: Interrupted, waited_s: float) -> str:
    """Why a request on ``route`` fails for good: the device suspected (or one ``now`` lacks) left."""
    left = [s.node_id for s in route.stages if now is None or now.index_of(s.node_id) is None]
    who = exc.device or (left[0] if left else None)
    return (f"{'device ' + who if who else 'a device'} of plan {route.plan_version} "
            f"({exc}) and no plan could serve within {waited_s:g}s; retry the request")
