"""N stage services and a coordinator on loopback in one process: the pipeline without OS processes.

The pipeline, stage, cloud, outline and CUDA tests run their requests through this harness.
"""

from decoding.pipeline_local import even_split
from decoding.sampling import SamplingParams, SamplingSpec
from meshd.pipeline.coordinator.service import PipelineCoordinator
from meshd.pipeline.route import Route, StageEndpoint
from meshd.pipeline.stage import StageService
from meshd.pipeline.stage.prefix_cache import PrefixCache
from transport.node import TransportNode
from tests.support.coordinator import generate_on


class Mesh:
    """N stage services and a coordinator on loopback, CURVE off (in-process test harness)."""

    def __init__(self, source, n, version=1, max_kv_tokens=1 << 16, prefix_share=0.5, groups=None, **stage_kw):
        """``prefix_share``: each stage's prefix cache share of its KV budget (0: the cache off);
        ``groups``: how many devices each route has, in order (default: one pipeline over all n;
        ``[1, 1]``: two whole-model replicas; ``[1, 2]``: a replica and a 2-stage pipeline)."""
        self.source, self.n, self.version = source, n, version
        self.groups = list(groups) if groups is not None else [n]
        assert sum(self.groups) == n
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
        self.routes = self.layout(self.version, [f"dev{i}" for i in range(self.n)], self.groups)
        self.route = self.routes[0]
        for s in self.services:
            await s.deploy(next(r for r in self.routes if r.index_of(s.node_id) is not None))
        self.coord.set_routes(self.routes)
        return self

    def layout(self, version, nodes, groups):
        """Routes of ``version`` over ``nodes`` in order, ``groups`` devices per route, layers split evenly."""
        routes, k = [], 0
        for index, size in enumerate(groups):
            ranges = even_split(self.source.config.num_layers, size)
            routes.append(Route(version, tuple(StageEndpoint(nodes[k + j], self.dir[nodes[k + j]][0], "", a, b)
                                               for j, (a, b) in enumerate(ranges)), index=index))
            k += size
        return tuple(routes)

    async def replan(self, version, nodes, groups, gone=()):
        """The devices ``gone`` leave; the leader re-plans ``version`` over ``nodes`` in ``groups``."""
        for i in gone:
            await self.services[i].server.close()
        self.routes = self.layout(version, nodes, groups)
        self.route = self.routes[0]
        self.coord.set_route(None)
        for svc in self.services:
            own = next((r for r in self.routes if r.index_of(svc.node_id) is not None), None)
            if own is not None:
                await svc.deploy(own)
        self.coord.set_routes(self.routes)

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
        return [t async for t in generate_on(self.coord, rid, prompt, max_tokens, SamplingSpec(sampling), **kw)]
