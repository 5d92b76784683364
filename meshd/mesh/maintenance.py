"""The control plane's clock: one loop that keeps this device's view of its home current.

Heartbeats out, link probes, members marked suspect or gone, the debounced re-plan and the
workload check all run on the same short tick, so none of them can starve another and one
failing tick never ends liveness tracking. What lies outside the control plane (the cloud
record's refresh) rides on the heartbeat as a callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from meshd.log import get_logger
from meshd.mesh.gossip import Gossip
from meshd.mesh.membership import Debouncer
from meshd.mesh.peerlink import PeerLink
from meshd.mesh.planner import Planner
from meshd.mesh.view import MeshView

log = get_logger("meshd.mesh.maintenance")


class Maintenance:
    def __init__(self, view: MeshView, gossip: Gossip, link: PeerLink, planner: Planner, debounce: Debouncer,
                 heartbeat_interval_s: float, replan_debounce_s: float, clock: Callable[[], float],
                 on_heartbeat: Callable[[], None] = lambda: None):
        self.view, self.gossip, self.link, self.planner, self.debounce = view, gossip, link, planner, debounce
        self.heartbeat_interval_s = heartbeat_interval_s
        self.step_s = max(0.05, min(heartbeat_interval_s, replan_debounce_s) / 4)
        self.clock = clock
        self.on_heartbeat = on_heartbeat
        self._next_beat = 0.0
        self._last_tick: float | None = None

    def stalled(self, now: float) -> float:
        """How long this loop could not run since the last tick, beyond its step (0: on time). Lateness
        under a step is the scheduler's ordinary jitter; a missed step is a stall (a busy machine,
        a blocked loop), logged when it lasts a second."""
        last, self._last_tick = self._last_tick, now
        late = 0.0 if last is None else now - last - self.step_s
        if late <= self.step_s:
            return 0.0
        if late >= 1.0:
            log.info("loop_stalled", seconds=round(late, 2))
        return late

    def tick(self) -> None:
        now = self.clock()
        # the stall goes to membership first: a failing step after it cannot lose it
        self.gossip.apply(self.view.membership.tick(now, self.stalled(now)))
        if now >= self._next_beat:
            self.gossip.send_heartbeat()
            self.on_heartbeat()
            self._next_beat = now + self.heartbeat_interval_s
        self.link.probe_due()  # round trips, in background tasks: never waits here
        if self.debounce.due(now):
            self.planner.maybe_replan()
        self.planner.check_workload()

    async def run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # never let one bad tick end liveness tracking
                log.exception("maintenance_failed")
            await asyncio.sleep(self.step_s)
