"""A pipeline stage: a thin service over a scheduler, a worker, a sampler and an outbox.

A message's way through a stage, top to bottom: the transport queues it
(``transport.link.StageServer.inbox``); :mod:`.service` takes what queued and
runs one step over it — schedule, execute, update. :mod:`.scheduler` decides
which messages share a pass and admits each to its sequence's slot
(:mod:`.slot`; the KV cache is the scheduler's, what the slot's positions hold
is :mod:`.prefix_cache`'s); :mod:`.worker` runs the pass in the compute thread
(and the layers an early exit skipped); on the last stage :mod:`.sampler` turns
its logits into tokens in the same hop; :mod:`.outbox` sends the result on, or
reports the failure naming the node that failed (:mod:`.errors`).
"""

from meshd.pipeline.stage.service import StageService
from meshd.pipeline.stage.stats import StageStats

__all__ = ["StageService", "StageStats"]
