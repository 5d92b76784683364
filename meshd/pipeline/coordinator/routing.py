"""Which route a request takes when the plan has several: whole-model replicas, a pipeline group.

The leader's layout (``partition.layout``) decides which routes exist for the home's
workload; each coordinator decides, per request, which one it takes, from what it
sees live: how many of its requests each route is running, and how much of this
prompt each route's stages already hold in their prefix caches (a conversation's
next turn belongs where its prompt is cached). A cold prompt counts as one more
request waiting on a route, shrunk by the route's stage count (a pipeline prefills
it that much faster); ties go to the route with fewer stages (fewer hops per token),
then the lower number. Requests that continue a kept prefix (outline children) go
where that prefix lives.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from meshd.pipeline.route import Route


@dataclass(frozen=True)
class RouteLoad:
    """What a coordinator knows about one route when a request arrives."""

    route: Route
    running: int  # this coordinator's requests on it now
    held: int = 0  # positions of this prompt every stage of it holds (prefix cache)


def route_score(load: RouteLoad, prompt_len: int) -> tuple[float, int, int]:
    """Lower is better: requests ahead plus the prompt's uncached share (per stage), then stages, then number."""
    uncached = (prompt_len - min(load.held, prompt_len)) / max(1, prompt_len)
    stages = max(1, len(load.route.stages))
    return (load.running + uncached / stages, stages, load.route.index)


def pick_route(loads: list[RouteLoad], prompt_len: int) -> Route:
    return min(loads, key=lambda load: route_score(load, prompt_len)).route


class RouteCounts:
    """Requests this coordinator runs on each route (taken when one is picked, so a burst spreads)."""

    def __init__(self) -> None:
        self._running: Counter = Counter()

    def take(self, route: Route) -> None:
        self._running[route.key] += 1

    def give(self, route: Route) -> None:
        self._running[route.key] -= 1
        if self._running[route.key] <= 0:
            del self._running[route.key]

    def running(self, route: Route) -> int:
        return self._running.get(route.key, 0)

    def to_dict(self) -> dict[str, int]:
        return {f"{v}/{i}": n for (v, i), n in sorted(self._running.items())}
