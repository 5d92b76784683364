"""The mesh's inference engine: the client API's requests, run through the pipeline.

It plugs into the daemon's engine seam (``engine = "meshd.pipeline.engine:mesh_engine"``):
every daemon serves its stage of the current plan, and the daemon that received
a request coordinates it. Errors are mapped to the API's vocabulary: no plan
yet → 503, prompt over the context → 413, a device failing mid-request → a
clear in-band error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from decoding.sampling import SamplingParams
from meshd.engine import Engine, GenerationFailed, GenerationRequest, NoPlan, model_id_of
from meshd.log import get_logger
from meshd.pipeline.coordinator import NoRoute, PipelineCoordinator, PipelineError
from meshd.pipeline.route import Route

log = get_logger("meshd.pipeline.engine")

MIN_CHUNK = 32  # shorter sub-sequences cost more in per-message overhead than they win in overlap


def default_cuts(prompt_len: int, num_stages: int) -> list[int]:
    """Equal sub-sequences (about two per stage, none under MIN_CHUNK) until a planned table exists."""
    if num_stages <= 1:
        return []
    k = max(1, min(2 * num_stages, prompt_len // MIN_CHUNK))
    return [round(prompt_len * i / k) for i in range(1, k)]


class PipelineEngine(Engine):
    def __init__(self, source, coordinator: PipelineCoordinator,
                 cuts_for: Callable[[int, Route], list[int]] | None = None):
        self.source = source
        self.tokenizer = source.tokenizer
        self.model_id = model_id_of(source)
        self.context_length = source.config.max_position
        self.coordinator = coordinator
        self.cuts_for = cuts_for or (lambda n, route: default_cuts(n, len(route.stages)))

    @property
    def in_flight(self) -> int:
        return self.coordinator.in_flight

    async def token_ids(self, req: GenerationRequest) -> AsyncIterator[int]:
        route = self.coordinator.route
        if route is None:
            raise NoPlan("the mesh has no plan yet (devices are still joining or loading their layers)")
        sampling = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed)
        try:
            await self.coordinator.wait_ready(route)
            cuts = self.cuts_for(len(req.prompt_ids), route)
            async for tok in self.coordinator.generate(req.request_id, list(req.prompt_ids), req.max_tokens,
                                                       sampling, self.eos_ids, cuts=cuts):
                yield tok
        except NoRoute as exc:
            raise NoPlan(str(exc)) from exc
        except PipelineError as exc:
            raise GenerationFailed(str(exc)) from exc
        except asyncio.TimeoutError as exc:
            raise GenerationFailed("the pipeline did not become ready in time") from exc
