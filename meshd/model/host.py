"""This device's model: open it, serve its pipeline stage, settle its profile, say when it is ready.

The one place the daemon's control plane meets the serving floors (``meshd.pipeline``,
``meshd.cloud``): the model host loads in the background, so the control plane and the
API's status answer meanwhile, and a model that fails to load leaves a working
control-plane member that says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from typing import Any

from meshd.config import Config
from meshd.engine.draining import DrainingEngine, load_engine_factory
from meshd.errors import USER_ERRORS
from meshd.log import get_logger
from meshd.mesh.gossip import Gossip
from meshd.mesh.planner import Planner
from meshd.mesh.view import MeshView
from meshd.sdnotify import Notifier
from partition.ids import NodeId

log = get_logger("meshd.daemon")


class ModelHost:
    """``sharing``: the model-sharing service (``meshd.share``), when this device may fetch its
    model from the home; ``on_engine``: hands a loaded engine to the API."""

    def __init__(self, config: Config, view: MeshView, planner: Planner, gossip: Gossip, cloud_sync,
                 node, stopping: asyncio.Event, sharing=None):
        self.config = config
        self.view = view
        self.local = view.local
        self.planner = planner
        self.gossip = gossip
        self.cloud_sync = cloud_sync
        self.node = node  # the control link's transport node: the stage and coordinator serve on it
        self.stopping = stopping
        self.sharing = sharing
        self.engine: DrainingEngine | None = None
        self.serving = None  # meshd.pipeline.serving.ServingRole: this device's stage, coordinator, plans
        self.announced = asyncio.Event()  # set with daemon_ready: work for later (lending's hashing) waits for it

    async def open_configured_engine(self) -> DrainingEngine | None:
        """The engine a ``--engine module:factory`` names (called with the config), else None."""
        if self.config.engine:
            made = load_engine_factory(self.config.engine)(self.config)
            engine = await made if inspect.isawaitable(made) else made
            if engine is not None:
                self.engine = DrainingEngine(engine)
                self.local.load_state = "loaded"
        elif not self.config.model_enabled:
            log.info("engine_disabled", reason="model = none")
        return self.engine

    @property
    def loads_mesh_engine(self) -> bool:
        return self.engine is None and self.config.model_enabled and not self.config.engine

    async def load_mesh_engine(self, on_engine: Callable[[DrainingEngine], None]) -> None:
        """The default engine: serve this device's pipeline stage and coordinate local requests.

        Runs in the background (reading the model and tokenizer takes seconds);
        status and 503s are served meanwhile.
        """
        cfg = self.config
        log.info("model_loading", model=cfg.model or "embedded default")
        try:
            from decoding.device import default_cpu_mode

            # which mode "auto" is depends on whether the integer kernels build: compile them (seconds,
            # once) in a thread, before the planner and the status ask on the event loop
            await asyncio.to_thread(default_cpu_mode)
            from decoding.speculative.draft_model import tokenizer_fingerprint
            from meshd.engine.drafting import DraftModels
            from meshd.pipeline.engine import PipelineEngine
            from meshd.pipeline.serving import start_serving

            self.serving = s = await start_serving(
                cfg, self.view, self.node, sharing=self.sharing, weights_mode=self.planner.weights_mode,
                follow_plans=self.planner.listeners.append, choose_mode=self._choose_mode)
            self.local.model_source = s.source
            self.local.stage_port = s.stage_port
            self.local.group_port = s.group_port
            self._check_fit(s.source)
            await self._settle_profile(s.source)
            drafts = DraftModels(cfg.draft_model, s.source) if cfg.draft_model else None
            engine = PipelineEngine(s.source, s.coordinator, cuts_for=s.cuts, wait_s=cfg.request_wait_s,
                                    draft_model=drafts, exit_threshold=cfg.exit_threshold)
            await self.cloud_sync.attach(s.coordinator.node, tokenizer_fingerprint(s.source.tokenizer), engine)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a missing model must not take the control plane down
            self.local.load_state = "failed"
            self.local.last_error = f"model load failed: {exc}"[:300]
            log.error("model_load_failed", error=f"{type(exc).__name__}: {exc}",
                      exc_info=not isinstance(exc, USER_ERRORS))
            return
        if self.stopping.is_set():
            return
        self.engine = DrainingEngine(engine)
        on_engine(self.engine)
        self.local.load_state = "loaded"
        log.info("model_ready", model=engine.model_id, identity=self.local.model_identity()[0])
        self.gossip.send_heartbeat()  # peers may plan with us now
        self.planner.poke()
        self.planner.check_home_model()

    async def _choose_mode(self, source) -> None:
        """``--weights auto`` on a CPU: serve in the mode this CPU measured fastest on this model
        (``meshd.model.mode_choice``; kept in the state directory), and say why in ``meshd status``.
        With self-profiling off the CPU's flags decide (``decoding.device.default_cpu_mode``)."""
        import torch

        from meshd.config import placement_of
        from meshd.model.mode_choice import settle

        cfg = self.config
        placement = placement_of(cfg)
        if str(cfg.weights or "auto").strip().lower() != "auto" or str(cfg.dtype or "auto").lower() != "auto":
            self.local.mode_how = f"{placement.mode} (as configured)"
            return
        if placement.device.type != "cpu":
            self.local.mode_how = f"{placement.mode} (the default on {placement.device})"
            return
        if cfg.self_profile == "off":
            self.local.mode_how = f"{placement.mode} (from the CPU's flags: self-profiling is off)"
            return
        try:
            choice = await asyncio.to_thread(settle, self.view.state, source, torch.get_num_threads())
        except Exception as exc:  # noqa: BLE001 - timing failed: the flags' guess still serves
            self.local.mode_how = f"{placement.mode} (from the CPU's flags; timing failed: {exc})"[:300]
            log.warning("numeric_mode_timing_failed", error=f"{type(exc).__name__}: {exc}")
            return
        cfg.weights = choice.mode
        self.local.mode_how = choice.describe()
        log.info("numeric_mode", mode=choice.mode, how=choice.how)

    def _check_fit(self, source) -> None:
        """Say at once when this device alone cannot hold the model (and what to do)."""
        from meshd.config import placement_of
        from meshd.model.fit import PACKED_BYTES_PER_WEIGHT, fit_advice

        placement = placement_of(self.config)
        per_weight = PACKED_BYTES_PER_WEIGHT if placement.packed else placement.dtype.itemsize
        advice = fit_advice(source.config, per_weight, self.config.memory_budget_mb,
                            self.config.model or "the embedded model", placement.mode)
        if advice:
            log.warning("model_larger_than_device", advice=advice)

    async def _settle_profile(self, source) -> None:
        """Plan this device by its own speed: its installed profile of this model, or a quick
        measurement now, before it counts as loaded (``meshd.model.self_profile``)."""
        import torch

        from meshd.config import placement_of
        from meshd.mesh.home_plan import shipped_profiles_dir
        from meshd.model.self_profile import settle

        try:
            on_cpu = placement_of(self.config).device.type == "cpu"
            result = await asyncio.to_thread(
                settle, self.view.state, source, mode=self.config.self_profile, threads=torch.get_num_threads(),
                on_cpu=on_cpu, reference_dirs=[shipped_profiles_dir()], weights=self.planner.weights_mode)
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not stop serving
            self.local.profile_how = f"shipped default: measuring failed ({type(exc).__name__}: {exc})"[:300]
            log.warning("self_profile_failed", error=f"{type(exc).__name__}: {exc}")
            self.local.own_profile = None
            return
        self.local.profile_how = result.how
        self.local.own_profile = result.profile
        log.info("profile_settled", how=result.how)

    # -- what status and the heartbeats read ----------------------------------------------
    def in_flight(self) -> int:
        return self.engine.in_flight if self.engine else 0

    def ready(self) -> bool:
        """A request sent now would start at once: the current plan has served a warm-up."""
        if self.engine is None:
            return False
        if self.serving is None:  # engines without a pipeline (tests' fakes) are ready once loaded
            return True
        return self.view.plan is not None and self.serving.warm_version == self.view.plan.version

    def workload(self) -> dict:
        """What this device's coordinator saw of the home's requests ({}: not enough yet, or no pipeline)."""
        return self.serving.coordinator.workload.snapshot() if self.serving is not None else {}

    def stage_status(self) -> dict[str, Any] | None:
        """This device's stage: plan served, layers, sequences and KV tokens in use."""
        if self.serving is None:
            return None
        from meshd.pipeline.totals import DecodingTotals

        coord = self.serving.coordinator
        totals = getattr(self.engine.inner, "totals", None) if self.engine is not None else None
        totals = totals if totals is not None else DecodingTotals()
        spec = {**totals.speculative.to_dict(), "round_cost_slope": round(coord.round_cost.slope, 4)}
        out = {**self.serving.stage.status(), "requests_replayed": coord.resumes, "speculative": spec,
               "outline": totals.outline.to_dict(), "exit_requests": totals.exits.to_dict()}
        out["prefix_cache"] = {**out.get("prefix_cache", {}), "requests": coord.prefixes.totals.to_dict()}
        cloud = self.cloud_sync.status()
        if cloud is not None:
            out["cloud"] = cloud
        return out

    def peer_restarted(self, node_id: NodeId) -> None:
        if self.serving is not None:
            self.serving.coordinator.stage_restarted(node_id)

    # -- start-up and shutdown -------------------------------------------------------------
    async def wait_ready(self, notifier: Notifier) -> None:
        """READY=1 once a request would be served at once (model loaded, a plan warm).

        Until then STATUS= says what the daemon waits for. A daemon whose model
        failed to load (or that runs none) is ready as a control-plane member.
        """
        home = self.view.home.name if self.view.home else "?"
        while not self.stopping.is_set():
            inner = self.engine.inner if self.engine is not None else None
            warm = self.serving.warm if self.serving is not None else None
            plan = self.view.plan
            if self.local.load_state in ("failed", "none") or (inner is not None and warm is None):
                break
            if self.serving is not None and getattr(self.serving, "model_mismatch", ""):
                break  # another model than the home's: up as a control-plane member, saying why
            if warm is not None and warm.is_set():
                break
            waiting = ("fetching the model from members of the home (none may hold it yet: "
                       "`meshd model pull` with this daemon's MESHD_HOME puts it here)"
                       if self.local.load_state == "fetching" else
                       "loading the model" if inner is None else
                       "waiting for a plan and its stages to load" if plan is None else
                       f"warming up plan v{plan.version}")
            notifier.status(f"home {home}: {waiting}")
            if warm is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await warm.wait()
            else:
                await asyncio.sleep(0.2)
        notifier.ready(f"serving home {home!r} as {self.view.node_id}")
        log.info("daemon_ready", home=home, load_state=self.local.load_state)
        self.announced.set()

    async def drain_stage(self, clock: Callable[[], float]) -> None:
        """Finish stage work other daemons' requests are doing here (bounded by drain_timeout_s).

        Heartbeats keep saying "draining" meanwhile; whatever is still running at
        the deadline is replayed by its coordinator once we are gone.
        """
        stage = self.serving.stage if self.serving is not None else None
        if stage is None or not stage.foreign_sequences():
            return
        log.info("stage_draining", sequences=stage.foreign_sequences())
        deadline = clock() + self.config.drain_timeout_s
        while stage.foreign_sequences() and clock() < deadline:
            await asyncio.sleep(0.1)
        if stage.foreign_sequences():
            log.warning("stage_drain_timeout", sequences=stage.foreign_sequences())

    async def aclose(self) -> None:
        closers = [getattr(self.engine.inner, "aclose", None) if self.engine is not None else None,
                   self.serving.aclose if self.serving is not None else None]
        for closer in closers:
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
