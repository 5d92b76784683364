"""Taking a seat in a plan's tensor group: the links formed, this member's share loaded, and then leading
(the stage service serves a :class:`GroupedStage`) or following (the first member's passes, until the
next plan).

Everything here runs in the stage's compute thread: the group's sockets belong to it.
"""

from __future__ import annotations

import threading

from decoding.tensor_group import GroupLost
from meshd.log import get_logger
from meshd.pipeline.route import StageEndpoint
from meshd.pipeline.tensor.grouped import GroupedStage
from meshd.pipeline.tensor.member import follow, load_member
from transport.group_link import GroupLink, GroupPeer

log = get_logger("meshd.pipeline.tensor")


def form(stage: StageEndpoint, rank: int, keypair, bind: str, epoch: int) -> GroupLink:
    """This member's links to the rest of ``stage``'s group (for plan ``epoch``), once every handshake has
    passed."""
    missing = [s.node_id for s in stage.group if not s.address]
    if missing:
        raise GroupLost(f"no group address known for {', '.join(missing)} yet")
    link = GroupLink(rank, len(stage.group), keypair, bind=bind, epoch=epoch)
    try:
        link.connect([GroupPeer(r, s.address, s.public_key.encode()) for r, s in enumerate(stage.group) if r != rank])
    except BaseException:
        link.close()
        raise
    return link


def lead(source, stage: StageEndpoint, keypair, bind: str, epoch: int) -> GroupedStage:
    """Rank 0: the links, this member's share, and the stage the service serves."""
    link = form(stage, 0, keypair, bind, epoch)
    try:
        member, split = load_member(source, stage.first, stage.end, len(stage.group), 0, link, stage.group_speeds or None,
                                    stage.group_attention)
    except BaseException:
        link.close()
        raise
    log.info("tensor_group_leading", members=[s.node_id for s in stage.group], layers=[stage.first, stage.end])
    return GroupedStage(member, link, split)


def follow_seat(source, stage: StageEndpoint, rank: int, keypair, bind: str, epoch: int,
                stopping: threading.Event) -> None:
    """Rank > 0: the links and this member's share, then the first member's passes until it stops, the
    group is lost, or ``stopping`` is set (a new plan: it ends even a pass waiting on the others)."""
    link = form(stage, rank, keypair, bind, epoch)
    link.abort_when(stopping)
    try:
        member, _ = load_member(source, stage.first, stage.end, len(stage.group), rank, link,
                                stage.group_speeds or None, stage.group_attention)
        log.info("tensor_group_following", members=[s.node_id for s in stage.group], rank=rank,
                 layers=[stage.first, stage.end])
        follow(member, link, stopping)
    except GroupLost as exc:
        log.warning("tensor_group_lost", rank=rank, error=str(exc))
    finally:
        link.close()
