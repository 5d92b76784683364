"""A stage's progress reports: to whom, for what, and only while its compute advances."""

import asyncio

import torch

from meshd.mesh.caps import Cap
from meshd.pipeline.stage.progress import ProgressReporter, waiting_by_coordinator
from tests.support.waiting import eventually
from transport.stage_messages import FreeSequence, StageForward, StageProgress


def forward(seq, reply_to):
    return StageForward(request_id=f"r-{seq}", plan_version=1, seq_id=seq, position_offset=0, chunk_index=0,
                        token_ids=torch.tensor([1, 2]), reply_to=reply_to)


def test_waiting_work_is_grouped_by_the_coordinator_that_waits_on_it_once_per_sequence():
    msgs = [forward("a:1", "a|tcp://x"), FreeSequence(1, "a:9"), forward("b:1", "b|tcp://y"),
            forward("a:1", "a|tcp://x"), forward("a:2", "a|tcp://x"), forward("c:1", "")]
    assert waiting_by_coordinator(msgs) == {"a|tcp://x": ["a:1", "a:2"], "b|tcp://y": ["b:1"]}


class Outbox:
    """Records reports; ``old`` names coordinators from a release without ``Cap.PROGRESS``."""

    def __init__(self, old=()):
        self.sent, self.old = [], set(old)

    def reads(self, node_id, cap):
        return cap is not Cap.PROGRESS or node_id not in self.old

    async def report(self, reply_to, msg):
        self.sent.append((reply_to, msg))


async def test_reports_go_only_while_the_count_grows_and_only_to_coordinators_that_read_them():
    outbox = Outbox(old={"b"})
    reporter = ProgressReporter("dev0", outbox, every_s=0.01)
    count = [0]
    reporter.holding = [forward("a:1", "a|tcp://x")]
    queued = [forward("b:1", "b|tcp://y")]
    task = asyncio.create_task(reporter.run_forever(lambda: count[0], lambda: queued))
    try:
        await asyncio.sleep(0.1)  # sleep-ok: ten report intervals with nothing computed
        assert outbox.sent == []  # nothing computed: a stuck stage says nothing
        count[0] = 7
        await eventually(lambda: outbox.sent, 5, "a report after the count grew")
        await asyncio.sleep(0.1)  # sleep-ok: ten more intervals with the count unchanged
        assert outbox.sent == [("a|tcp://x", StageProgress("dev0", ["a:1"], 7))]  # one word per advance
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert reporter.sent == 1
