"""The stage's word that a long pass is advancing, to every coordinator with work waiting on it.

A coordinator cannot tell a slow device from a dead one by the clock: a 3,000-token
Home Assistant prompt takes seconds on one CPU and minutes on another, and a wait
sized for one speed replays the other's prompt for ever. So while a step runs, the
stage tells each coordinator whose sequences it computes or holds queued (behind
someone else's long prompt, say) that it is advancing — but only when its model's
count of computed rows x layers grew since the last word. A compute thread that is
stuck stops the words, and the coordinator's timeout then means what it says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from meshd.log import get_logger
from meshd.mesh.caps import Cap
from meshd.pipeline.stage.outbox import StageOutbox
from partition.ids import NodeId
from transport.stage_messages import StageForward, StageProgress

log = get_logger("meshd.stage")

__all__ = ["PROGRESS_EVERY_S", "ProgressReporter", "waiting_by_coordinator"]

#: How often a stage says it advances during a pass. Well under any coordinator's token
#: timeout; a pass shorter than this (every decode step) sends nothing.
PROGRESS_EVERY_S = 2.0


def waiting_by_coordinator(msgs: Iterable[Any]) -> dict[str, list[str]]:
    """The sequences with work among ``msgs``, by the coordinator (``reply_to``) that waits on them."""
    out: dict[str, list[str]] = {}
    for m in msgs:
        if isinstance(m, StageForward) and m.reply_to and m.seq_id not in out.get(m.reply_to, ()):
            out.setdefault(m.reply_to, []).append(m.seq_id)
    return out


class ProgressReporter:
    def __init__(self, node_id: NodeId, outbox: StageOutbox, every_s: float = PROGRESS_EVERY_S):
        self.node_id = node_id
        self.outbox = outbox
        self.every_s = every_s
        self.sent = 0  # reports sent (a stage's status shows them)
        self.holding: list = []  # the messages of the step running now, not yet done (the stage sets it)

    def held_seqs(self, queued: Iterable[Any]) -> set[str]:
        """The sequences with work here now: the running step's, and ``queued`` behind it."""
        return {m.seq_id for m in (*self.holding, *queued) if isinstance(m, StageForward)}

    async def run_forever(self, done: Callable[[], int], queued: Callable[[], Iterable[Any]]) -> None:
        """Every ``every_s``, if ``done()`` (the model's rows x layers, raised by the compute thread) grew,
        tell the coordinators of the work held here: :attr:`holding`, then ``queued()`` behind it (none
        while idle). One task for the stage's life, so a decode step pays nothing for it."""
        last = done()
        while True:
            await asyncio.sleep(self.every_s)
            now = done()
            if now == last:  # nothing computed since the last word: say nothing
                continue
            last = now
            try:
                held = [*self.holding, *queued()] if self.holding else []
                sends = [self._tell(reply_to, seqs, now) for reply_to, seqs in waiting_by_coordinator(held).items()
                         if self.outbox.reads(reply_to.partition("|")[0], Cap.PROGRESS)]
                await asyncio.gather(*sends)
            except Exception as exc:  # noqa: BLE001 - one bad round must not silence the stage for good
                log.warning("progress_report_failed", error=f"{type(exc).__name__}: {exc}")

    async def _tell(self, reply_to: str, seqs: list[str], done: int) -> None:
        await self.outbox.report(reply_to, StageProgress(self.node_id, seqs, done))
        self.sent += 1
