"""A pipeline stage: a thin service over a scheduler, a worker and a sampler.

A message's way through a stage, top to bottom: :mod:`.service` receives it and
checks it against the plan; :mod:`.scheduler` admits it to its sequence's slot
(the KV cache is the scheduler's) and decides which messages share a pass;
:mod:`.worker` runs the pass in the compute thread; on the last stage
:mod:`.sampler` turns its logits into tokens in the same hop; the service sends
the result on, or reports the failure naming the node that failed (:mod:`.errors`).
"""

from meshd.pipeline.stage.service import StageService
from meshd.pipeline.stage.stats import StageStats

__all__ = ["StageService", "StageStats"]
