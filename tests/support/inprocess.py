"""N stage services and a coordinator on loopback in one process: the pipeline without OS processes.

The pipeline, stage, cloud, outline and CUDA tests run their requests through this harness.
"""

from decoding.pipeline_local import even_split
from decoding.sampling import SamplingParams, SamplingSpec
from meshd.pipeline.coordinator import PipelineCoordinator
from meshd.pipeline.route import Route, StageEndpoint
from meshd.pipeline.stage import StageService
from meshd.pipeline.stage.prefix_cache import PrefixCache
from transport.node import TransportNode


class Mesh:
    """N stage services and a coordinator on loopback, CURVE off (in-process test harness)."""

    def __init__(self, source, n, version=1, max_kv_tokens=1 << 16, prefix_share=0.5, **stage_kw):
        """``prefix_share``: each stage's prefix cache share of its KV budget (0: the cache off)."""
        self.source, self.n, self.version = source, n, version
        self.max_kv_tokens = max_kv_tokens
        self.prefix_share = prefix_share
        self.stage_kw = stage_kw
        self.dir = {}

    async def __aenter__(self):
        self.nodes = [TransportNode(f"dev{i}", curve=False) for i in range(self.n + 1)]
        self.services = []
        for i in range(self.n):
            svc = StageService(self.nodes[i], f"dev{i}", self.source, self.dir.__getitem__,
                               max_kv_tokens=self.max_kv_tokens, prefix_cache=PrefixCache(self.prefix_share),
                               **self.stage_kw)
            self.dir[f"dev{i}"] = (await svc.start(), "")
            self.services.append(svc)
        self.coord = PipelineCoordinator(self.nodes[-1], "coord", self.dir.__getitem__, token_timeout_s=20,
                                         prefix_cache=self.prefix_share > 0)
        self.dir["coord"] = (await self.coord.start(), "")
        ranges = even_split(self.source.config.num_layers, self.n)
        self.route = Route(self.version, tuple(StageEndpoint(f"dev{i}", self.dir[f"dev{i}"][0], "", a, b)
                                               for i, (a, b) in enumerate(ranges)))
        for s in self.services:
            await s.deploy(self.route)
        self.coord.set_route(self.route)
        return self

    async def __aexit__(self, *exc):
        await self.coord.close()
        for s in self.services:
            await s.close()
        for nd in self.nodes:
            await nd.close()

    async def drop_middle(self) -> None:
        """Of three devices the middle one leaves; the leader re-plans over the other two (plan 2)."""
        await self.services[1].server.close()
        ranges = even_split(self.source.config.num_layers, 2)
        survivors = (self.route.stages[0], self.route.stages[2])
        new = Route(2, tuple(StageEndpoint(s.node_id, s.address, "", a, b) for s, (a, b) in zip(survivors, ranges)))
        self.coord.set_route(None)
        for svc in (self.services[0], self.services[2]):
            await svc.deploy(new)
        self.coord.set_route(new)
        self.route = new

    async def run(self, prompt, max_tokens, sampling=SamplingParams(), rid="r1", **kw):
        return [t async for t in self.coord.generate(rid, prompt, max_tokens, SamplingSpec(sampling), **kw)]
