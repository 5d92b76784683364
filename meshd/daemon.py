"""The meshd daemon: builds the control plane's objects, wires them, orders start and stop.

    config + state dir ─┬─ transport (CURVE control link, ZAP allow-list)   meshd.mesh.peerlink
                        ├─ the view of the home (members, facts, plan)     meshd.mesh.view
                        ├─ gossip (heartbeats, member lists, profiles)     meshd.mesh.gossip
                        ├─ planner (the leader's re-plan, conflicts)       meshd.mesh.planner
                        ├─ admission (pairing, mDNS, connecting members)   meshd.mesh.admission
                        ├─ model host (engine, stage, profile, readiness)  meshd.model.host
                        ├─ model sharing                                   meshd.share
                        ├─ client API (unix socket, LAN listeners)         meshd.api
                        └─ sd_notify (READY, WATCHDOG, STOPPING)           meshd.sdnotify

Each job lives in its own object; this module only decides what is built, who is told
about whom, and in which order things start and stop.

Shutdown (SIGTERM/SIGINT): refuse new requests (503 with a clear message),
give in-flight ones ``drain_timeout_s`` to finish and fail the rest with a
clear error, tell peers "bye", withdraw the mDNS record, close the API
(removing the socket file), exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable

import structlog
import zmq

from decoding.offload.loop import PreviewSettings
from meshd.cloud.sync import CloudSync
from meshd.config import Config
from meshd.engine.draining import DaemonError
from meshd.log import get_logger
from meshd.mesh import control
from meshd.mesh.admission import Admission
from meshd.mesh.discovery import select_interfaces
from meshd.mesh.gossip import Gossip
from meshd.mesh.local import LocalMember
from meshd.mesh.maintenance import Maintenance
from meshd.mesh.membership import Debouncer, Membership
from meshd.mesh.peerlink import PeerLink, probe_interval_for
from meshd.mesh.planner import Planner
from meshd.mesh.status import StatusDocument
from meshd.mesh.view import MeshView
from meshd.model.host import ModelHost
from meshd.sdnotify import Notifier
from meshd.share.deps import ShareDeps, ShareSettings, share_address
from meshd.share.service import start_sharing
from meshd.state import RUNTIME_FILE, Member, StateDir, atomic_write, key_fingerprint
from partition.ids import NodeId
from transport.errors import TransportError

log = get_logger("meshd.daemon")

_PORT_HINT = ("; if another meshd runs on this machine, give this one --port 0 --pairing-port 0 "
              "(and its own --state-dir and --socket)")


class Daemon:
    def __init__(self, config: Config, env: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.env = dict(os.environ if env is None else env)
        self.clock = clock
        self.state = StateDir(config.resolved_state_dir(self.env))
        self.socket_path = config.resolved_socket(self.env)
        self.notifier = Notifier(self.env)
        self.stopping = asyncio.Event()
        self.local = LocalMember(config.name, config.memory_budget_mb,
                                 "loading" if config.model_enabled or config.engine else "none", clock)
        self.debounce = Debouncer(config.replan_debounce_s)
        self.view: MeshView | None = None
        self.planner: Planner | None = None
        self.gossip: Gossip | None = None
        self.admission: Admission | None = None
        self.models: ModelHost | None = None
        self.status_doc: StatusDocument | None = None
        self.link: PeerLink | None = None
        self.sharing = None  # meshd.share.service.ShareService: lends model pieces, fetches missing ones
        self.cloud_sync = CloudSync(self.state, config.cloud_budget, config.cloud_min_timeout_s,
                                    home_keys=lambda: self.view.home_keys() if self.view else [],
                                    on_error=self.local.note_error,
                                    previews=PreviewSettings(config.cloud_preview_threshold, config.cloud_previews)
                                    if config.cloud_previews else None)
        self.api_runner = None
        self.api_app = None
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ----------------------------------------------------------
    async def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT (or :meth:`request_stop`), stop. Returns 0."""
        # Bind the node id before installing signal handlers: their callbacks run
        # in the context captured here, so even "shutdown_requested" names the node.
        self.state.ensure()
        structlog.contextvars.bind_contextvars(node=self.state.node_id())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        try:
            await self.start()
            await self.stopping.wait()
        finally:
            await self.stop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        return 0

    def request_stop(self, why: str = "requested") -> None:
        if not self.stopping.is_set():
            log.info("shutdown_requested", reason=why)
            self.stopping.set()

    def _build(self) -> None:
        """The control plane's objects, wired to one another (no sockets yet)."""
        cfg, local = self.config, self.local
        self.state.ensure()
        local.node_id = NodeId(self.state.node_id())
        structlog.contextvars.bind_contextvars(node=local.node_id)
        home = self.state.home()
        if home is None:
            raise DaemonError("this device is not in a home yet: run 'meshd join --new-home NAME' "
                              "or 'meshd join --token TOKEN' (from 'meshd invite' on a member)")
        local.public_key = self.state.keypair().public.decode()
        self.state.add_members([Member(local.node_id, cfg.name, local.public_key)])
        local.own_profile = self.state.own_profile()
        local.started_at = self.clock()
        membership = Membership(local.node_id, cfg.suspect_after_s, cfg.gone_after_s)
        self.view = view = MeshView(self.state, local, membership, home, select_interfaces(cfg.interface))
        probe_s = probe_interval_for(cfg.heartbeat_interval_s)
        self.link = PeerLink(local.node_id, self.state.root, lambda key, env: self.gossip.on_message(key, env),
                             send_timeout_s=max(0.2, cfg.heartbeat_interval_s),
                             probe_interval_s=probe_s, probe_timeout_s=min(2.0, probe_s), clock=self.clock)
        self.planner = Planner(cfg, view, self.link, self.debounce, self.clock, say_status=self.notifier.status)
        self.planner.observe_workload = self._home_workload
        self.gossip = Gossip(view, self.planner, self.link, self.cloud_sync, self.clock, extras=self._heartbeat_extras,
                             on_members_learned=lambda: self.admission.reclassify(),
                             on_peer_restarted=lambda nid: self.models.peer_restarted(nid))
        self.admission = Admission(cfg, view, self.gossip, self.clock)
        self.models = ModelHost(cfg, view, self.planner, self.gossip, self.cloud_sync, self.link.node, self.stopping)
        self.status_doc = StatusDocument(
            cfg, view, self.planner, self.admission, self.clock, engine=lambda: self.models.engine,
            stage_status=self.models.stage_status, ready=self.models.ready, draining=self.stopping.is_set,
            sharing_status=lambda: self.sharing.status() if self.sharing is not None else None,
            link_status=lambda: self.link.link_status() if self.link is not None else {})

    def _heartbeat_extras(self) -> dict:
        """Heartbeat fields owned outside the control plane: shutdown, requests, KV, the cloud record."""
        return {"state": "draining" if self.stopping.is_set() else "ready",
                "requests_in_flight": self.models.in_flight(),
                "kv_tokens": int((self.models.stage_status() or {}).get("kv_tokens_in_use") or 0),
                "workload": self.models.workload() or None,
                **self.cloud_sync.heartbeat_fields()}

    def _home_workload(self):
        """The home's workload: this coordinator's and every ready member's, as heartbeats carry them."""
        from meshd.pipeline.coordinator.workload import combine

        peers = [self.view.info_of(n).get("workload") or {} for n in self.view.ready_ids() if n != self.view.node_id]
        return combine([self.models.workload(), *peers])

    def _share_deps(self) -> ShareDeps:
        """What model sharing needs of this device: its transport, the view's members and addresses,
        and three callbacks (fetching changes the load state; a holdings change re-plans, soon or now)."""
        view, local = self.view, self.local
        return ShareDeps(
            local.node_id, ShareSettings.from_config(self.config), self.state.models_dir, self.link.node,
            self.link.broadcast, self.link.send, view.membership.ready_ids,
            address_of=lambda nid: share_address(view.membership.state_of(nid), view.addresses.get(nid),
                                                 view.members.get(nid)),
            model_fetching=lambda on: setattr(local, "load_state", "fetching" if on else "loading"),
            holdings_changed=self.planner.poke, replan_now=self.planner.maybe_replan,
            device_ready=self.models.announced.wait)

    async def start(self) -> None:
        cfg = self.config
        self._build()
        try:
            self.local.port = await self.link.start(cfg.listen, cfg.port)
        except (zmq.ZMQError, TransportError) as exc:
            raise DaemonError(f"cannot listen on {cfg.listen}:{cfg.port} (--port): {exc}"
                              f"{_PORT_HINT if cfg.port else ''}") from None
        self.sharing = await start_sharing(self._share_deps())
        self.planner.sharing = self.models.sharing = self.sharing
        self.gossip.fallback = self.sharing.on_control  # model sharing: adverts and fetch targets
        try:
            await self.admission.start_pairing()
        except OSError as exc:
            raise DaemonError(f"cannot listen on {cfg.listen}:{cfg.pairing_port} (--pairing-port): "
                              f"{exc.strerror or exc}{_PORT_HINT if cfg.pairing_port else ''}") from None
        self._write_runtime_file()  # before the API answers, so `meshd invite` sees real ports
        await self._start_api()
        await self.admission.start_discovery()
        self.planner.poke()  # first plan: this node alone, until peers answer
        maintenance = Maintenance(self.view, self.gossip, self.link, self.planner, self.debounce, cfg.heartbeat_interval_s,
                                  cfg.replan_debounce_s, self.clock, on_heartbeat=self.cloud_sync.tick)
        self._tasks.append(asyncio.create_task(maintenance.run(), name="maintenance"))
        if self.notifier.watchdog_interval_s:
            self._tasks.append(asyncio.create_task(self._watchdog_loop(), name="watchdog"))
        self._tasks.append(asyncio.create_task(self.models.wait_ready(self.notifier), name="readiness"))
        log.info("daemon_started", home=self.view.home.name, name=cfg.name, port=self.local.port,
                 pairing_port=self.local.pairing_port, socket=str(self.socket_path),
                 interfaces=[i.name for i in self.view.interfaces], fingerprint=key_fingerprint(self.local.public_key))

    async def _start_api(self) -> None:
        try:
            from meshd.api.server import create_app, set_engine, start_api
        except ImportError:  # the API package is optional for the control plane
            log.warning("api_unavailable")
            return
        from meshd.apikeys import ApiKeyStore

        cfg = self.config
        engine = await self.models.open_configured_engine()
        self.api_app = create_app(engine, self.status, engine_wait_s=cfg.request_wait_s,
                                  engine_loading=lambda: self.local.load_state in ("loading", "fetching"),
                                  api_keys=ApiKeyStore(self.state.root), model_aliases=cfg.model_aliases,
                                  debug_responses=cfg.debug_responses, require_keys=cfg.require_keys)
        self.api_runner = await start_api(self.api_app, self.socket_path, cfg.api_listen,
                                          http=cfg.http, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
        if self.models.loads_mesh_engine:  # loading weights takes a while: serve status (and 503s) meanwhile
            load = self.models.load_mesh_engine(on_engine=lambda e: set_engine(self.api_app, e))
            self._tasks.append(asyncio.create_task(load, name="model-load"))

    async def stop(self) -> None:
        """Graceful shutdown; safe to call after a failed or partial start.

        Order matters: refuse new requests first, let running ones finish (the
        heartbeats keep going meanwhile, marked "draining", so peers do not
        re-plan under a request that is still using them), then say bye,
        withdraw the mDNS record, and close the API (which removes its socket).
        """
        self.notifier.stopping()
        models = self.models
        engine = models.engine if models is not None else None
        log.info("daemon_stopping", in_flight=engine.in_flight if engine else 0)
        if engine is not None:
            await engine.drain(self.config.drain_timeout_s)
        if models is not None:
            await models.drain_stage(self.clock)
        await self.cloud_sync.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if models is not None:
            await models.aclose()
        if self.planner is not None:
            self.planner.withdraw()
        if self.sharing is not None:
            with contextlib.suppress(Exception):
                await self.sharing.aclose()
        if self.link is not None and self.gossip is not None:
            self.link.broadcast(control.Bye(self.local.node_id))
            await self.link.flush(0.5)
        if self.admission is not None:
            await self.admission.stop_discovery()
        if self.api_runner is not None:
            await self.api_runner.cleanup()  # closes the listener, removes the socket file
            self.api_runner = None
        if self.admission is not None:
            await self.admission.stop_pairing()
        if self.link is not None:
            await self.link.stop()
            self.link = None
        with contextlib.suppress(FileNotFoundError):
            (self.state.root / RUNTIME_FILE).unlink()
        log.info("daemon_stopped")

    async def _watchdog_loop(self) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_interval_s)

    def _write_runtime_file(self) -> None:
        """Ports, addresses and the API socket, for ``meshd invite`` and ``meshd status --state-dir``."""
        info = {"pid": os.getpid(), "node_id": self.local.node_id, "port": self.local.port,
                "pairing_port": self.local.pairing_port,
                "addresses": [a for i in self.view.interfaces for a in i.addresses],
                "socket": str(self.socket_path)}
        atomic_write(self.state.root / RUNTIME_FILE, json.dumps(info).encode(), mode=0o644)

    def status(self) -> dict:
        """The status document (served by the API as ``GET /v1/mesh/status``)."""
        return self.status_doc.document()
