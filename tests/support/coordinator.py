"""What tests and benchmarks ask of a pipeline coordinator that the product never does.

The API's engine reads a request's steps (:meth:`PipelineCoordinator.steps`), labels and
counts them; a test or a benchmark only wants the token ids, so this shorthand lives in
the harness, not on the coordinator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from decoding.sampling import SamplingSpec
from meshd.pipeline.coordinator.service import PipelineCoordinator
from meshd.pipeline.coordinator.slot import Cuts, StepsRequest
from partition.ids import RequestId


async def generate_on(coord: PipelineCoordinator, request_id: RequestId, prompt_ids: list[int], max_tokens: int,
                      sampling: SamplingSpec, eos_ids=(), cuts: Cuts = None,
                      chunks: int | None = None) -> AsyncIterator[int]:
    """Yield the sampled token ids (EOS included, as the last one) of one request on ``coord``."""
    async for step in coord.steps(StepsRequest(request_id, prompt_ids, max_tokens, sampling, eos_ids,
                                               cuts=cuts, chunks=chunks)):
        yield step.token
