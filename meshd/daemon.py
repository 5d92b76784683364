"""The meshd daemon: one asyncio object that wires every part together.

    config + state dir ─┬─ transport (CURVE control link, ZAP allow-list)
                        ├─ pairing endpoint (invite tokens)
                        ├─ mDNS (advertise + browse, classify sightings)
                        ├─ membership (heartbeats -> joining/ready/suspect/gone)
                        ├─ plan (debounced re-plan by the lowest ready node id)
                        ├─ client API (unix socket, from meshd.api)
                        └─ sd_notify (READY, WATCHDOG, STOPPING)

I/O lives here; the decisions live in the small pure modules (membership,
discovery.classify, plan). Bad input from the network is logged and dropped;
nothing a peer sends can stop the daemon.

Shutdown (SIGTERM/SIGINT): refuse new requests (503 with a clear message),
give in-flight ones ``drain_timeout_s`` to finish and fail the rest with a
clear error, tell peers "bye", withdraw the mDNS record, close the API
(removing the socket file), exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import inspect
import ipaddress
import json
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
import zmq

from meshd import control
from meshd.cloud.sync import CloudSync
from meshd.config import Config
from meshd.discovery import (
    PROTOCOL_VERSION, REASON_UNREACHABLE, Advert, Discovery, Sighting, classify, select_interfaces,
)
from meshd.engine import Engine, EngineUnavailable, GenerationRequest, TokenStream
from meshd.errors import USER_ERRORS, MeshdError
from meshd.log import get_logger
from meshd.membership import Change, Debouncer, Membership, PeerState, affects_plan
from meshd.pairing import PairingServer
from meshd.peerlink import PeerLink, probe_interval_for
from meshd.plan import MemberInput, Plan, make_plan, model_name, not_planned, plannable_members
from meshd.sdnotify import Notifier
from meshd.self_profile import describe as describe_profile
from meshd.state import (RUNTIME_FILE, Home, Member, StateDir, atomic_write, json_digest, key_fingerprint,
                         members_digest)
from partition.ids import NodeId, PlanVersion
from transport.errors import TransportError
from transport.messages import Envelope, PlanUpdate

log = get_logger("meshd.daemon")

_PORT_HINT = ("; if another meshd runs on this machine, give this one --port 0 --pairing-port 0 "
              "(and its own --state-dir and --socket)")
LAST_PAIRING_PORT_FILE = "pairing_port"  # kept across restarts: tokens name this port
SHUTDOWN_MESSAGE = "meshd is shutting down on this device; retry the request"


class DaemonError(MeshdError):
    pass


# --------------------------------------------------------------------------- draining engine


class DrainingEngine(Engine):
    """Wraps the real engine so shutdown can refuse new requests and cut running ones.

    ``draining``: new requests fail at once with 503 ``engine_unavailable``.
    ``aborting``: running ones fail at their next token with the same clear
    message (in-band for streams), instead of a connection reset.
    """

    def __init__(self, inner: Engine):
        self.inner = inner
        self.draining = False
        self.aborting = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    model_id = property(lambda self: self.inner.model_id)
    source = property(lambda self: getattr(self.inner, "source", None))
    vocab_size = property(lambda self: getattr(self.inner, "vocab_size", None))
    context_length = property(lambda self: self.inner.context_length)
    tokenizer = property(lambda self: self.inner.tokenizer)
    supports_constraints = property(lambda self: getattr(self.inner, "supports_constraints", False))
    supports_penalties = property(lambda self: getattr(self.inner, "supports_penalties", False))
    supports_outline = property(lambda self: getattr(self.inner, "supports_outline", False))
    supports_cloud = property(lambda self: getattr(self.inner, "supports_cloud", False))

    def token_ids(self, req: GenerationRequest) -> TokenStream:
        return TokenStream.relay(self.inner.token_ids(req), self._guarded)

    async def _guarded(self, inner: AsyncIterator[int]) -> AsyncIterator[int]:
        if self.draining:
            raise EngineUnavailable(SHUTDOWN_MESSAGE)
        self.in_flight += 1
        self.idle.clear()
        try:
            async with contextlib.aclosing(inner) as ids:
                async for tid in ids:
                    if self.aborting:
                        raise EngineUnavailable(SHUTDOWN_MESSAGE + " (the request was cut short)")
                    yield tid
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()


def load_engine_factory(spec: str) -> Callable[..., Any]:
    """``module:attr`` -> the callable (the seam for the pipeline engine and test fakes)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise DaemonError(f"engine must be 'module:factory', got {spec!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise DaemonError(f"cannot load engine {spec!r}: {exc}") from None


# --------------------------------------------------------------------------- daemon


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
        self.node_id = ""
        self.public_key = ""
        self.home: Home | None = None
        self.members: dict[str, Member] = {}
        self.by_key: dict[str, str] = {}
        self.membership: Membership | None = None
        self.debounce = Debouncer(config.replan_debounce_s)
        self.plan: Plan | None = None
        self.replans = 0
        self.plan_conflict = False  # a member serves another plan under our version: re-plan above it
        self._unknown_fields_seen: set[tuple[str, str, tuple[str, ...]]] = set()
        self.plan_listeners: list[Callable[[Plan], Any]] = []
        self.sightings: dict[str, Sighting] = {}
        self.addresses: dict[str, tuple[str, int]] = {}  # node id -> (ip, transport port)
        self.profiles: dict[str, dict] = {}  # node id -> shared profile
        self.profile_digests: dict[str, str] = {}
        self.own_profile: dict | None = None
        self.profile_how = ""  # how this device came by the profile it is planned with (set once the model is open)
        self.interfaces = []
        self.link: PeerLink | None = None
        self.pairing: PairingServer | None = None
        self.discovery: Discovery | None = None
        self.api_runner = None
        self.api_app = None
        self.engine: DrainingEngine | None = None
        self.cloud_sync = CloudSync(self.state, config.cloud_budget, config.cloud_min_timeout_s,
                                    home_keys=self._home_keys, on_error=self._note_error)
        self.serving = None  # meshd.pipeline.serving.ServingRole: this device's stage, coordinator, plans
        self.sharing = None  # meshd.share.service.ShareService: lends model pieces, fetches missing ones
        self.port = 0
        self.pairing_port = 0
        self.stage_port = 0  # set by the mesh engine once its stage service listens
        self.incarnation = secrets.token_hex(6)  # peers see a restart as a new incarnation
        self.load_state = "loading" if config.model_enabled or config.engine else "none"
        self.excluded: dict[str, str] = {}  # ready members the last plan left out, and why
        self._warned_model = ""  # the home model this device was last warned it does not hold
        self._tasks: list[asyncio.Task] = []
        self._started_at = 0.0
        self.last_error = ""  # shown per member by `meshd status` (sent in heartbeats)

    # -- lifecycle ----------------------------------------------------------
    async def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT (or :meth:`request_stop`), stop. Returns 0."""
        # Bind the node id before installing signal handlers: their callbacks run
        # in the context captured here, so even "shutdown_requested" names the node.
        self.state.ensure()
        self.node_id = self.state.node_id()
        structlog.contextvars.bind_contextvars(node=self.node_id)
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

    async def start(self) -> None:
        cfg = self.config
        self.state.ensure()
        self.node_id = self.state.node_id()
        structlog.contextvars.bind_contextvars(node=self.node_id)
        self.home = self.state.home()
        if self.home is None:
            raise DaemonError("this device is not in a home yet: run 'meshd join --new-home NAME' "
                              "or 'meshd join --token TOKEN' (from 'meshd invite' on a member)")
        keypair = self.state.keypair()
        self.public_key = keypair.public.decode()
        self.state.add_members([Member(self.node_id, cfg.name, self.public_key)])
        self._reload_members()
        self.own_profile = self.state.own_profile()
        self.membership = Membership(self.node_id, cfg.suspect_after_s, cfg.gone_after_s)
        self._started_at = self.clock()
        self.interfaces = select_interfaces(cfg.interface)

        probe_s = probe_interval_for(cfg.heartbeat_interval_s)
        self.link = PeerLink(self.node_id, self.state.root, self._on_message,
                             send_timeout_s=max(0.2, cfg.heartbeat_interval_s),
                             probe_interval_s=probe_s, probe_timeout_s=min(2.0, probe_s), clock=self.clock)
        try:
            self.port = await self.link.start(cfg.listen, cfg.port)
        except (zmq.ZMQError, TransportError) as exc:
            raise DaemonError(f"cannot listen on {cfg.listen}:{cfg.port} (--port): {exc}"
                              f"{_PORT_HINT if cfg.port else ''}") from None
        from meshd.share.service import start_sharing

        self.sharing = await start_sharing(self, replan_now=self._maybe_replan)
        self.pairing = PairingServer(self.state, self._on_admitted)
        try:
            self.pairing_port = await self._start_pairing(cfg)
        except OSError as exc:
            raise DaemonError(f"cannot listen on {cfg.listen}:{cfg.pairing_port} (--pairing-port): "
                              f"{exc.strerror or exc}{_PORT_HINT if cfg.pairing_port else ''}") from None
        self._write_runtime_file()  # before the API answers, so `meshd invite` sees real ports

        await self._start_api()
        self.discovery = Discovery(self._advert(), self.interfaces, self._classify, self._on_sighting)
        await self.discovery.start()
        self.debounce.poke(self.clock())  # first plan: this node alone, until peers answer
        self._tasks.append(asyncio.create_task(self._maintenance_loop(), name="maintenance"))
        if self.notifier.watchdog_interval_s:
            self._tasks.append(asyncio.create_task(self._watchdog_loop(), name="watchdog"))
        self._tasks.append(asyncio.create_task(self._ready_when_serving(), name="readiness"))
        log.info("daemon_started", home=self.home.name, name=cfg.name, port=self.port,
                 pairing_port=self.pairing_port, socket=str(self.socket_path),
                 interfaces=[i.name for i in self.interfaces], fingerprint=key_fingerprint(self.public_key))

    async def _start_pairing(self, cfg) -> int:
        """Listen for pairing. With ``--pairing-port 0`` the port this state dir had last time comes
        first: invite tokens name it, and one minted before a restart should still work."""
        remembered = self.state.root / LAST_PAIRING_PORT_FILE
        port = 0
        if not cfg.pairing_port:
            try:
                last = int(remembered.read_text().strip())
            except (OSError, ValueError):
                last = 0
            if 0 < last < 65536:
                try:
                    port = await self.pairing.start(cfg.listen, last)
                except OSError:
                    log.info("pairing_port_moved", previous=last,
                             reason="taken since the last start; invite tokens minted before it need renewing")
        port = port or await self.pairing.start(cfg.listen, cfg.pairing_port)
        atomic_write(remembered, f"{port}\n".encode(), mode=0o644)
        return port

    async def _ready_when_serving(self) -> None:
        """READY=1 once a request would be served at once (model loaded, a plan warm).

        Until then STATUS= says what the daemon waits for. A daemon whose model
        failed to load (or that runs none) is ready as a control-plane member.
        """
        home = self.home.name if self.home else "?"
        while not self.stopping.is_set():
            inner = self.engine.inner if self.engine is not None else None
            warm = self.serving.warm if self.serving is not None else None
            if self.load_state in ("failed", "none") or (inner is not None and warm is None):
                break
            if self.serving is not None and getattr(self.serving, "model_mismatch", ""):
                break  # another model than the home's: up as a control-plane member, saying why
            if warm is not None and warm.is_set():
                break
            waiting = ("fetching the model from members of the home (none may hold it yet: "
                       "`meshd model pull` with this daemon's MESHD_HOME puts it here)"
                       if self.load_state == "fetching" else
                       "loading the model" if inner is None else
                       "waiting for a plan and its stages to load" if self.plan is None else
                       f"warming up plan v{self.plan.version}")
            self.notifier.status(f"home {home}: {waiting}")
            if warm is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await warm.wait()
            else:
                await asyncio.sleep(0.2)
        self.notifier.ready(f"serving home {home!r} as {self.node_id}")
        log.info("daemon_ready", home=home, load_state=self.load_state)

    async def _start_api(self) -> None:
        try:
            from meshd.api.server import create_app, start_api
        except ImportError:  # the API package is optional for the control plane
            log.warning("api_unavailable")
            return
        cfg = self.config
        engine = None
        if cfg.engine:
            made = load_engine_factory(cfg.engine)(self)
            engine = await made if inspect.isawaitable(made) else made
        elif not cfg.model_enabled:
            log.info("engine_disabled", reason="model = none")
        self.engine = DrainingEngine(engine) if engine is not None else None
        if engine is not None:
            self.load_state = "loaded"
        from meshd.apikeys import ApiKeyStore

        self.api_app = create_app(self.engine, self.status, engine_wait_s=cfg.request_wait_s,
                                  engine_loading=lambda: self.load_state in ("loading", "fetching"),
                                  api_keys=ApiKeyStore(self.state.root), model_aliases=cfg.model_aliases,
                                  debug_responses=cfg.debug_responses, require_keys=cfg.require_keys)
        self.api_runner = await start_api(self.api_app, self.socket_path, cfg.api_listen,
                                          http=cfg.http, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
        if engine is None and cfg.model_enabled and not cfg.engine:
            # Loading weights takes a while: serve status (and 503s) meanwhile.
            self._tasks.append(asyncio.create_task(self._load_mesh_engine(), name="model-load"))

    async def _load_mesh_engine(self) -> None:
        """The default engine: serve this device's pipeline stage and coordinate local requests.

        Runs in the background (reading the model and tokenizer takes seconds);
        status and 503s are served meanwhile.
        """
        log.info("model_loading", model=self.config.model or "embedded default")
        try:
            from meshd.api.server import set_engine
            from meshd.pipeline.engine import PipelineEngine
            from meshd.drafting import DraftModels
            from meshd.pipeline.serving import start_serving

            self.serving = await start_serving(self)
            s = self.serving
            self._check_fit(s.source)
            await self._settle_profile(s.source)
            drafts = DraftModels(self.config.draft_model, s.source) if self.config.draft_model else None
            engine = PipelineEngine(s.source, s.coordinator, cuts_for=s.cuts, wait_s=self.config.request_wait_s,
                                    draft_model=drafts)
            from decoding.speculative.draft_model import tokenizer_fingerprint

            await self.cloud_sync.attach(s.coordinator.node, tokenizer_fingerprint(s.source.tokenizer), engine)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a missing model must not take the control plane down
            self.load_state = "failed"
            self.last_error = f"model load failed: {exc}"[:300]
            log.error("model_load_failed", error=f"{type(exc).__name__}: {exc}",
                      exc_info=not isinstance(exc, USER_ERRORS))
            return
        if self.stopping.is_set() or self.api_app is None:
            return
        self.engine = DrainingEngine(engine)
        set_engine(self.api_app, self.engine)
        self.load_state = "loaded"
        log.info("model_ready", model=engine.model_id, identity=self._model_identity()[0])
        self._send_heartbeat()  # peers may plan with us now
        self.debounce.poke(self.clock())
        self._check_home_model()

    @functools.cached_property
    def weights_mode(self) -> str:
        """The numeric mode this daemon's plans name when it leads: its own (``--weights``)."""
        from meshd.config import placement_of

        if not self.config.model_enabled:
            return ""
        try:
            return placement_of(self.config).mode
        except Exception:  # noqa: BLE001 - a device this machine lacks fails at start-up, loudly, elsewhere
            return ""

    def _check_fit(self, source) -> None:
        """Say at once when this device alone cannot hold the model (and what to do)."""
        from meshd.config import placement_of
        from meshd.model_fit import fit_advice

        from meshd.model_fit import PACKED_BYTES_PER_WEIGHT

        placement = placement_of(self.config)
        per_weight = PACKED_BYTES_PER_WEIGHT if placement.packed else placement.dtype.itemsize
        advice = fit_advice(source.config, per_weight, self.config.memory_budget_mb,
                            self.config.model or "the embedded model", placement.mode)
        if advice:
            log.warning("model_larger_than_device", advice=advice)

    async def _settle_profile(self, source) -> None:
        """Plan this device by its own speed: its installed profile of this model, or a quick
        measurement now, before it counts as loaded (``meshd.self_profile``)."""
        import torch

        from meshd.config import placement_of
        from meshd.plan import shipped_profiles_dir
        from meshd.self_profile import settle

        try:
            on_cpu = placement_of(self.config).device.type == "cpu"
            result = await asyncio.to_thread(
                settle, self.state, source, mode=self.config.self_profile, threads=torch.get_num_threads(),
                on_cpu=on_cpu, reference_dirs=[shipped_profiles_dir()], weights=self.weights_mode)
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not stop serving
            self.profile_how = f"shipped default: measuring failed ({type(exc).__name__}: {exc})"[:300]
            log.warning("self_profile_failed", error=f"{type(exc).__name__}: {exc}")
            self.own_profile = None
            return
        self.profile_how = result.how
        self.own_profile = result.profile
        log.info("profile_settled", how=result.how)

    @property
    def cloud(self):
        """The paired cloud verifier in use (``meshd.cloud.home.CloudHome``), if any."""
        return self.cloud_sync.home

    def _home_keys(self) -> list[str]:
        return sorted({m.public_key for m in self.members.values()})

    def _note_error(self, error: str) -> None:
        self.last_error = error

    async def stop(self) -> None:
        """Graceful shutdown; safe to call after a failed or partial start.

        Order matters: refuse new requests first, let running ones finish (the
        heartbeats keep going meanwhile, marked "draining", so peers do not
        re-plan under a request that is still using them), then say bye,
        withdraw the mDNS record, and close the API (which removes its socket).
        """
        self.notifier.stopping()
        log.info("daemon_stopping", in_flight=self.engine.in_flight if self.engine else 0)
        if self.engine is not None:
            self.engine.draining = True
            if self.engine.in_flight:
                try:
                    await asyncio.wait_for(self.engine.idle.wait(), self.config.drain_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("drain_timeout", cutting=self.engine.in_flight)
                    self.engine.aborting = True
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.engine.idle.wait(), 5.0)
        await self._drain_stage()
        await self.cloud_sync.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        closers = [getattr(self.engine.inner, "aclose", None) if self.engine is not None else None,
                   self.serving.aclose if self.serving is not None else None,
                   self.sharing.aclose if self.sharing is not None else None]
        for closer in closers:
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
        if self.link is not None and self.membership is not None:
            self.link.broadcast(control.Bye(self.node_id))
            await self.link.flush(0.5)
        if self.discovery is not None:
            with contextlib.suppress(Exception):
                await self.discovery.stop()
            self.discovery = None
        if self.api_runner is not None:
            await self.api_runner.cleanup()  # closes the listener, removes the socket file
            self.api_runner = None
        if self.pairing is not None:
            await self.pairing.stop()
            self.pairing = None
        if self.link is not None:
            await self.link.stop()
            self.link = None
        with contextlib.suppress(FileNotFoundError):
            (self.state.root / RUNTIME_FILE).unlink()
        log.info("daemon_stopped")

    async def _drain_stage(self) -> None:
        """Finish stage work other daemons' requests are doing here (bounded by drain_timeout_s).

        Heartbeats keep saying "draining" meanwhile; whatever is still running at
        the deadline is replayed by its coordinator once we are gone.
        """
        stage = self.serving.stage if self.serving is not None else None
        if stage is None or not stage.foreign_sequences():
            return
        log.info("stage_draining", sequences=stage.foreign_sequences())
        deadline = self.clock() + self.config.drain_timeout_s
        while stage.foreign_sequences() and self.clock() < deadline:
            await asyncio.sleep(0.1)
        if stage.foreign_sequences():
            log.warning("stage_drain_timeout", sequences=stage.foreign_sequences())

    # -- adverts & sightings ----------------------------------------------------
    def _advert(self) -> Advert:
        prof = self.own_profile
        digest = json_digest(prof) if prof else ""
        return Advert(
            node_id=self.node_id, name=self.config.name, protocol_version=PROTOCOL_VERSION,
            home_digest=self.home.digest if self.home else "",
            key_fingerprint=key_fingerprint(self.public_key),
            memory_budget_mb=self.config.memory_budget_mb, profile_digest=digest,
            port=self.port, pairing_port=self.pairing_port,
        )

    def _classify(self, advert: Advert) -> str | None:
        return classify(advert, self.node_id, self.home.digest if self.home else None, self.members)

    def _on_sighting(self, sighting: Sighting, removed: bool) -> None:
        if removed:
            self.sightings.pop(sighting.instance, None)
            log.info("mdns_service_removed", instance=sighting.instance)
            return
        self.sightings[sighting.instance] = sighting
        adv = sighting.advert
        log.info("mdns_service_seen", instance=sighting.instance, peer=adv.node_id if adv else None,
                 addresses=list(sighting.addresses), port=sighting.port,
                 admitted=sighting.reason is None, reason=sighting.reason)
        if sighting.reason is None and adv is not None:
            asyncio.ensure_future(self._admit(adv, sighting.addresses))

    def _pick_address(self, addresses: tuple[str, ...]) -> str | None:
        """Prefer an address on one of our own subnets (the one we can route to)."""
        if not addresses:
            return None
        ours = [ipaddress.IPv4Address(a) for i in self.interfaces for a in i.addresses]
        for a in addresses:
            ip = ipaddress.IPv4Address(a)
            if any(ip == o or (ip.packed[:3] == o.packed[:3]) for o in ours):
                return a
        return addresses[0]

    async def _admit(self, adv: Advert, addresses: tuple[str, ...]) -> None:
        member = self.members.get(adv.node_id)
        address = self._pick_address(addresses)
        if member is None or address is None or self.link is None or self.membership is None:
            return
        self.addresses[adv.node_id] = (address, adv.port)
        try:
            await self.link.connect(adv.node_id, member.public_key, address, adv.port)
        except Exception as exc:
            log.warning("peer_connect_failed", peer=adv.node_id, error=str(exc))
            return
        self._apply(self.membership.observe(adv.node_id, self.clock()))
        self._send_heartbeat(adv.node_id)

    def _reclassify(self) -> None:
        """The allow-list changed: sightings refused as "unpaired" may now be admissible."""
        for s in list(self.sightings.values()):
            if s.advert is None:
                continue
            reason = self._classify(s.advert)
            if reason != s.reason:
                s.reason = reason
                if reason is None:
                    asyncio.ensure_future(self._admit(s.advert, s.addresses))

    # -- members / keys -------------------------------------------------------------
    def _reload_members(self) -> None:
        self.members = self.state.members()
        self.by_key = {m.public_key: nid for nid, m in self.members.items()}

    def _on_admitted(self, member: Member) -> None:
        """Pairing admitted a device: tell every member its key (they admit it too)."""
        self._reload_members()
        if self.link is not None:
            self.link.broadcast(self._member_list())
        self._reclassify()

    def _member_list(self) -> control.MemberList:
        return control.MemberList([m.to_json() for m in self.members.values()])

    def _merge_members(self, entries: list[dict[str, str]], sender: str) -> None:
        incoming = []
        for e in entries:
            try:
                incoming.append(Member.from_json(e))
            except (KeyError, TypeError):
                log.warning("member_entry_malformed", sender=sender)
        # Never let gossip replace a key we already trust for a node id (that would
        # let one member hijack another's identity); only add unknown node ids.
        fresh = [m for m in incoming if m.node_id not in self.members]
        try:
            added = self.state.add_members(fresh)
        except USER_ERRORS as exc:
            log.warning("member_list_rejected", sender=sender, error=str(exc))
            return
        if added:
            log.info("members_learned", sender=sender, nodes=[m.node_id for m in added])
            self._reload_members()
            self._reclassify()

    # -- messages -------------------------------------------------------------------
    def _on_message(self, public_key: str, env: Envelope) -> None:
        sender = self.by_key.get(public_key)
        if sender is None:  # ZAP admitted it, so the allow-list changed under us
            self._reload_members()
            sender = self.by_key.get(public_key)
        msg = env.message
        if sender is None or self.membership is None:
            log.warning("message_from_unknown_key", type=type(msg).__name__,
                        fingerprint=_safe_fp(public_key))
            return
        now = self.clock()
        if env.unknown_fields:
            self._note_unknown_fields(sender, msg, env.unknown_fields)
        if isinstance(msg, control.MeshHeartbeat):
            info = {"name": msg.name, "memory_budget_mb": msg.memory_budget_mb,
                    "plan_version": msg.plan_version, "state": msg.state,
                    "requests_in_flight": msg.requests_in_flight, "stage_port": msg.stage_port,
                    "incarnation": msg.incarnation, "load_state": msg.load_state, "model": msg.model,
                    "model_layers": msg.model_layers, "version": msg.version,
                    "uptime_s": msg.uptime_s, "kv_tokens": msg.kv_tokens, "last_error": msg.last_error}
            peer = self.membership.peers.get(sender)
            before = dict(peer.info) if peer is not None else {}
            self._apply(self.membership.heartbeat(sender, now, info))
            self._on_peer_info(sender, before, info)
            if msg.members_digest != members_digest(self.members):
                self.link.send(sender, self._member_list())
            if msg.profile_digest and self.profile_digests.get(sender) != msg.profile_digest:
                self.link.send(sender, control.ProfileRequest(self.node_id))
            if self.plan is not None and msg.plan_version < self.plan.version:
                self.link.send(sender, PlanUpdate(self.plan.version, self.plan.to_assignment()))
            elif self.plan is not None and msg.plan_version == self.plan.version and msg.plan_digest \
                    and msg.plan_digest != self.plan.digest():
                self._on_plan_conflict(sender, msg.plan_version)
            share = self.cloud_sync.share_for(msg.cloud_changed_at, msg.cloud_digest)
            if share is not None:
                self.link.send(sender, share)
        elif isinstance(msg, control.MemberList):
            self._merge_members(msg.members, sender)
        elif isinstance(msg, control.CloudShare):
            self.cloud_sync.receive(msg.record, sender)
        elif isinstance(msg, control.ProfileRequest):
            prof = self.own_profile
            self.link.send(sender, control.ProfileShare(self.node_id, json_digest(prof) if prof else "", prof))
        elif isinstance(msg, control.ProfileShare):
            if msg.profile is not None:
                self.profiles[sender] = msg.profile
                self.profile_digests[sender] = msg.digest
                self.debounce.poke(now)
        elif isinstance(msg, PlanUpdate):
            self._on_plan_update(msg, sender)
        elif isinstance(msg, control.Bye):
            log.info("peer_said_bye", peer=sender, reason=msg.reason)
            self._apply(self.membership.leave(sender, now))
        elif self.sharing is not None and self.sharing.on_control(sender, msg):
            pass  # model sharing: adverts and fetch targets
        else:
            log.info("message_ignored", type=type(msg).__name__, peer=sender)

    def _note_unknown_fields(self, sender: str, msg: Any, fields: tuple[str, ...]) -> None:
        """A newer member's fields this daemon does without: said once per member and field set."""
        key = (sender, type(msg).__name__, fields)
        if key in self._unknown_fields_seen or len(self._unknown_fields_seen) > 256:
            return
        self._unknown_fields_seen.add(key)
        if len(self._unknown_fields_seen) > 256:  # bounded: say so once, then stop
            log.warning("peer_fields_unknown_suppressed", reason="too many distinct sets of unknown fields")
            return
        log.warning("peer_fields_unknown", peer=sender, type=type(msg).__name__, fields=list(fields),
                    peer_version=getattr(msg, "version", None) or None, version=_meshd_version(),
                    hint="the member runs another meshd version; upgrade every member to the same one")

    def _apply(self, changes: list[Change]) -> None:
        for c in changes:
            log.info("member_state", peer=c.node_id, old=c.old.value if c.old else None, new=c.new.value)
        if affects_plan(changes):
            self.debounce.poke(self.clock())

    # -- heartbeats, timeouts, re-plan --------------------------------------------------
    def _heartbeat(self) -> control.MeshHeartbeat:
        prof = self.own_profile
        return control.MeshHeartbeat(
            node_id=self.node_id, name=self.config.name, memory_budget_mb=self.config.memory_budget_mb,
            plan_version=self.plan.version if self.plan else 0,
            members_digest=members_digest(self.members), profile_digest=json_digest(prof) if prof else "",
            timestamp=time.time(), state="draining" if self.stopping.is_set() else "ready",
            requests_in_flight=self.engine.in_flight if self.engine else 0,
            stage_port=self.stage_port, incarnation=self.incarnation, load_state=self.load_state,
            model=self._model_identity()[0], model_layers=self._model_identity()[1],
            version=_meshd_version(), uptime_s=round(self.clock() - self._started_at, 1),
            kv_tokens=int((self._stage_status() or {}).get("kv_tokens_in_use") or 0),
            last_error=self.last_error, **self.cloud_sync.heartbeat_fields(),
            plan_digest=self.plan.digest() if self.plan else "",
        )

    def _send_heartbeat(self, node_id: str | None = None) -> None:
        if self.link is None:
            return
        hb = self._heartbeat()
        legacy = dataclasses.replace(hb, plan_digest="")  # left out on the wire: strict 0.1 daemons refuse it
        for peer in ([node_id] if node_id is not None else list(self.link.peers)):
            self.link.send(peer, hb if self._takes_extended_heartbeats(peer) else legacy)

    def _takes_extended_heartbeats(self, peer: str) -> bool:
        """Whether ``peer`` decodes heartbeat fields added since 0.1 (its heartbeats say its version)."""
        info = self.membership.peers[peer].info if self.membership and peer in self.membership.peers else {}
        return _version_tuple(str(info.get("version") or "")) >= EXTENSIBLE_HEARTBEATS_SINCE

    async def _maintenance_loop(self) -> None:
        cfg = self.config
        step = max(0.05, min(cfg.heartbeat_interval_s, cfg.replan_debounce_s) / 4)
        next_beat = 0.0
        while True:
            now = self.clock()
            try:
                if now >= next_beat:
                    self._send_heartbeat()
                    self.cloud_sync.tick()
                    next_beat = now + cfg.heartbeat_interval_s
                self.link.probe_due()  # round trips, in background tasks: never waits here
                self._apply(self.membership.tick(now))
                if self.debounce.due(now):
                    self._maybe_replan()
            except Exception:  # never let one bad tick end liveness tracking
                log.exception("maintenance_failed")
            await asyncio.sleep(step)

    async def _watchdog_loop(self) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_interval_s)

    def _model_identity(self) -> tuple[str, int]:
        """(identity of the loaded model file, its layer count); ("", 0) for model-less engines."""
        source = self.serving.source if self.serving is not None else None
        if source is None:
            return "", 0
        cached = getattr(self, "_identity_cache", None)
        if cached is None or cached[0] is not source:
            ident = str(getattr(source, "identity", "") or "")
            layers = int(getattr(getattr(source, "config", None), "num_layers", 0) or 0)
            self._identity_cache = cached = (source, ident, layers)
        return cached[1], cached[2]

    def _on_peer_info(self, node_id: str, before: dict, info: dict) -> None:
        """React to what a heartbeat changed: a restart, a new stage port, a model loaded."""
        old_inc = before.get("incarnation")
        if old_inc and old_inc != info.get("incarnation"):
            log.info("peer_restarted", peer=node_id, stage_port=info.get("stage_port"))
            if self.serving is not None:
                self.serving.coordinator.stage_restarted(node_id)
        if any(before.get(k) != info.get(k) for k in ("load_state", "model", "model_layers")):
            self.debounce.poke(self.clock())  # who can be planned over changed
            self._check_home_model()

    def _model_facts(self, ready: list[str]) -> dict[str, tuple[str, str, int]]:
        """Per ready member: (load state, model identity, layer count), from heartbeats and ourselves."""
        facts: dict[str, tuple[str, str, int]] = {}
        for nid in ready:
            if nid == self.node_id:
                ident, layers = self._model_identity()
                facts[nid] = (self.load_state, ident, layers)
            else:
                info = self.membership.peers[nid].info if nid in self.membership.peers else {}
                facts[nid] = (str(info.get("load_state", "loading")), str(info.get("model", "")),
                              int(info.get("model_layers", 0) or 0))
        return facts

    def _plannable(self, ready: list[str]) -> tuple[list[str], str, int, dict[str, str]]:
        """The members a plan may use: model loaded, and the same model file as the home's.

        The home's model is the one most loaded members hold (ties: the one the current
        plan serves, then the lowest node id's; ``meshd.plan.plannable_members``), so a
        device with another file is listed with its reason instead of silently mixing
        layers of two models.
        """
        members, model, layers, excluded = plannable_members(
            self._model_facts(ready), self.plan.model if self.plan is not None else "")
        return members, model, layers or self.config.plan_layers, excluded

    def _not_planned(self) -> dict[str, str]:
        """Why each ready member holds no layers of the current plan (on every member, not only
        the leader: ``meshd.plan.not_planned``)."""
        if self.membership is None:
            return {}
        return not_planned(self.plan, self._model_facts(self.membership.ready_ids()))

    def _check_home_model(self) -> None:
        """Say at once, once per home model, when this device holds another model than its home serves.

        The home's model is the current plan's (else the one most ready members hold).
        While this device's model still loads, its file name already tells a different
        model apart (an identity is "file name@sha256 prefix"), so ``meshd join`` warns as
        soon as the first plan arrives, not after seconds of loading. Such a device serves
        no layers and refuses requests (``meshd.pipeline``); the warning says what to change.
        """
        if self.membership is None:
            return
        own = self._model_identity()[0] if self.load_state == "loaded" else ""
        name = own.rpartition("@")[0] if own else self._configured_model_file
        if not name:
            return
        home = self.plan.model if self.plan is not None and self.plan.model else plannable_members(
            self._model_facts(self.membership.ready_ids()))[1]
        differs = home != own if own else home.rpartition("@")[0] not in ("", name)
        if not home or not differs or self._warned_model == home:
            return
        self._warned_model = home
        from meshd.model_store import model_flag_for

        log.warning("model_differs_from_home", holds=own or name, home_serves=home,
                    hint=f"every member of a home holds the same model: restart this device "
                         f"{model_flag_for(home)} (or move most of the home to {model_name(name)}); "
                         f"until then it serves no layers and refuses requests")

    @functools.cached_property
    def _configured_model_file(self) -> str:
        """The file name of the model this daemon opens ("" when none, or not on this device yet)."""
        if not self.config.model_enabled or self.config.engine:
            return ""
        from meshd.model_store import resolve_model

        try:
            return resolve_model(self.config.model or None).name
        except Exception:  # noqa: BLE001 - not here (fetched from the home, or missing): the load says so
            return ""

    def _maybe_replan(self) -> None:
        m = self.membership
        if m.leader() != self.node_id:
            return  # the coordinator (lowest ready node id) plans; we wait for its PlanUpdate
        all_ready = m.ready_ids()
        ready, model, num_layers, excluded = self._plannable(all_ready)
        if excluded != self.excluded:
            log.info("members_not_planned", excluded=excluded)
        self.excluded = excluded
        if not ready:
            log.info("replan_waiting", reason="no member has a model loaded yet", excluded=excluded)
            return
        seen = [int(m.peers[n].info.get("plan_version", 0)) for n in all_ready if n in m.peers]
        version = max([self.plan.version if self.plan else 0, *seen]) + 1
        plan_over = lambda ids: make_plan(version, self.node_id, self._plan_inputs(ids), num_layers,  # noqa: E731
                                          self.weights_mode, model)
        plan = plan_over(ready)
        if self.sharing is not None:  # a plan waits for members still fetching its layers (meshd.share.gate)
            plan = self.sharing.gate(plan, self.plan, ready, model, plan_over)
            if plan is None and self.plan_conflict and self.plan is not None:
                # Our plan goes on serving while members fetch, but not under a version
                # another plan holds too: re-issue it above both.
                plan = dataclasses.replace(self.plan, version=PlanVersion(version), leader=NodeId(self.node_id))
            if plan is None:
                return
        cur = self.plan
        if cur is not None and cur.digest() == plan.digest() and cur.weights == plan.weights \
                and cur.model == plan.model and cur.members == plan.members and cur.leader == self.node_id \
                and version <= cur.version + 1 and not self.plan_conflict:
            # Same assignment, mode, model and members: keep the version, so requests running on it
            # are not failed as stale and no stage reloads anything. (A member joining that the
            # planner leaves out still makes a new plan: status lists whom a plan was made over.)
            log.debug("replan_unchanged", version=cur.version)
            return
        self.replans += 1
        log.info("replan", version=version, members=ready, model=model, reason=plan.reason,
                 stages=[[s.node_id, s.first, s.end] for s in plan.stages])
        self._adopt(plan)
        self.link.broadcast(PlanUpdate(plan.version, plan.to_assignment()),
                            [n for n in all_ready if n != self.node_id])

    def _plan_inputs(self, ids: list[str]) -> list[MemberInput]:
        m = self.membership
        inputs = []
        for nid in ids:
            info = m.peers[nid].info if nid in m.peers else {}
            budget = self.config.memory_budget_mb if nid == self.node_id else int(
                info.get("memory_budget_mb", 0) or 0)
            profile = self.own_profile if nid == self.node_id else self.profiles.get(nid)
            inputs.append(MemberInput(nid, budget, profile))
        return inputs

    def _on_plan_update(self, msg: PlanUpdate, sender: str) -> None:
        try:
            plan = Plan.from_assignment(msg.plan_version, msg.assignment)
        except ValueError as exc:
            log.warning("plan_rejected", peer=sender, error=str(exc))
            return
        cur = self.plan
        # Strictly newer only: a stage checks the version alone, so two different plans
        # must never share one. (Two leaders of a briefly split home may both issue a
        # version; the lowest node id re-plans above both once the home is whole.)
        if cur is None or plan.version > cur.version:
            self._adopt(plan)
        elif plan.version == cur.version and plan.digest() != cur.digest():
            self._on_plan_conflict(sender, plan.version, plan.leader)

    def _on_plan_conflict(self, peer: str, version: int, their_leader: str = "") -> None:
        """Two plans share one version (two members each led a view of the home for a moment).

        Only the leader can settle it, and its own plan may look unchanged to it, so it
        re-plans under a new version even then; members that are not the leader wait for
        that (the leader sees the conflict in their heartbeats). Logged once per version.
        """
        if not self.plan_conflict:
            log.warning("plan_version_conflict", version=version, peer=peer, leader=their_leader or None,
                        ours=self.plan.digest() if self.plan else None,
                        settles=self.membership.leader() if self.membership else None)
        self.plan_conflict = True
        self.debounce.poke(self.clock())

    def _adopt(self, plan: Plan) -> None:
        self.plan = plan
        self.plan_conflict = False  # a newer version settles any conflict under the old one
        layers = plan.layers_of(self.node_id)
        log.info("plan_adopted", version=plan.version, leader=plan.leader,
                 layers=list(layers) if layers else None)
        ready = len(self.membership.ready_ids()) if self.membership else 1
        self.notifier.status(f"home {self.home.name if self.home else '?'}: {ready} member(s) ready, "
                             f"plan v{plan.version}, layers {list(layers) if layers else 'none'} here")
        self._check_home_model()
        for listener in self.plan_listeners:  # the pipeline engine redeploys layer ranges here
            try:
                listener(plan)
            except Exception:
                log.exception("plan_listener_failed")

    def _serving_ready(self) -> bool:
        """A request sent now would start at once: the current plan has served a warm-up."""
        if self.engine is None:
            return False
        if self.serving is None:  # engines without a pipeline (tests' fakes) are ready once loaded
            return True
        return self.plan is not None and self.serving.warm_version == self.plan.version

    def _stage_status(self) -> dict[str, Any] | None:
        """This device's stage: plan served, layers, sequences and KV tokens in use."""
        if self.serving is None:
            return None
        coord = self.serving.coordinator
        spec = dict(coord.spec_totals)
        spec["accepted_per_round"] = round((spec["accepted"] + spec["rounds"]) / spec["rounds"], 3) \
            if spec["rounds"] else 0.0
        spec["round_cost_slope"] = round(coord.round_cost.slope, 4)
        out = {**self.serving.stage.status(), "requests_replayed": coord.resumes, "speculative": spec,
               "outline": {k: dict(v) if isinstance(v, dict) else v for k, v in coord.outline_totals.items()}}
        cloud = self.cloud_sync.status()
        if cloud is not None:
            out["cloud"] = cloud
        return out

    def _links_status(self) -> dict[str, dict[str, Any]]:
        """Per linked member: round trip (``rtt_s``, None unless fresh), ``age_s``, ``reachable``;
        ``bytes_sent``: activation bytes this device's stage sent it."""
        links = self.link.link_status() if self.link is not None else {}
        stage = self.serving.stage.status() if self.serving is not None else {}
        for nid, n in (stage.get("activation_bytes_to") or {}).items():
            links.setdefault(nid, {})["bytes_sent"] = n
        return links

    # -- runtime file for `meshd invite` -----------------------------------------------
    def _write_runtime_file(self) -> None:

        info = {"pid": os.getpid(), "node_id": self.node_id, "port": self.port,
                "pairing_port": self.pairing_port,
                "addresses": [a for i in self.interfaces for a in i.addresses],
                "socket": str(self.socket_path)}
        atomic_write(self.state.root / RUNTIME_FILE, json.dumps(info).encode(), mode=0o644)

    # -- status (served by the API as GET /v1/mesh/status) ---------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock()
        m = self.membership
        plan = self.plan
        members = []
        for nid, member in sorted(self.members.items()):
            layers = plan.layers_of(nid) if plan else None
            if nid == self.node_id:
                state, last_seen, budget = "ready", 0.0, self.config.memory_budget_mb
                address = self.interfaces[0].addresses[0] if self.interfaces else None
                port = self.port
                info = {"version": _meshd_version(), "uptime_s": round(now - self._started_at, 1),
                        "model": self._model_identity()[0],
                        "kv_tokens": (self._stage_status() or {}).get("kv_tokens_in_use"),
                        "last_error": self.last_error}
            else:
                peer = m.peers.get(nid) if m else None
                state = peer.state.value if peer else "offline"
                last_seen = round(now - peer.last_seen, 3) if peer else None
                budget = peer.info.get("memory_budget_mb") if peer else None
                address, port = self.addresses.get(nid, (None, None))
                info = peer.info if peer else {}
            members.append({
                "node_id": nid, "name": member.name, "state": state, "self": nid == self.node_id,
                "address": f"{address}:{port}" if address else None,
                "memory_budget": budget, "layers": list(layers) if layers else None,
                "last_seen_s": last_seen, "fingerprint": _safe_fp(member.public_key),
                "version": info.get("version") or None, "uptime_s": info.get("uptime_s"),
                "model_digest": (info.get("model") or "").rpartition("@")[2] or None,
                "kv_tokens": info.get("kv_tokens"), "last_error": info.get("last_error") or None,
                "profile": describe_profile(self.own_profile if nid == self.node_id else self.profiles.get(nid)),
            })
        not_admitted = []
        for s in self.sightings.values():
            reason = s.reason
            adv = s.advert
            if reason is None and adv is not None and m is not None:
                st = m.state_of(adv.node_id)
                if st is PeerState.GONE or (
                    st in (None, PeerState.JOINING) and now - self._started_at > self.config.gone_after_s):
                    reason = REASON_UNREACHABLE
            if reason is not None:
                not_admitted.append({
                    "name": adv.name if adv else s.instance, "node_id": adv.node_id if adv else None,
                    "address": f"{s.addresses[0]}:{s.port}" if s.addresses else None,
                    "reason": reason,
                })
        return {
            "node_id": self.node_id,
            "name": self.config.name,
            "home": {"name": self.home.name, "digest": self.home.digest} if self.home else None,
            "state": "draining" if self.stopping.is_set() else "serving",
            "protocol_version": PROTOCOL_VERSION,
            "ports": {"transport": self.port, "pairing": self.pairing_port},
            "members": members,
            "not_admitted": sorted(not_admitted, key=lambda d: (d["reason"], str(d["name"]))),
            "interfaces": [{"name": i.name, "addresses": list(i.addresses)} for i in self.interfaces],
            "plan": plan.to_status() if plan else None,
            "replans": self.replans,
            "model": self.engine.model_id if self.engine else None,
            "model_identity": self._model_identity()[0] or None,
            "load_state": self.load_state,
            "profile": self.profile_how,
            "ready": self._serving_ready(),
            "not_planned": [{"node_id": n, "name": self.members[n].name if n in self.members else None,
                             "reason": r} for n, r in sorted(self._not_planned().items())],
            "stage": self._stage_status(),
            "links": self._links_status(),
            "sharing": self.sharing.status() if self.sharing is not None else None,
            "requests_in_flight": self.engine.in_flight if self.engine else 0,
            "recent": {"tokens_per_s": None, "ttft_s": None},
            "version": _meshd_version(),
            "uptime_s": round(now - self._started_at, 1) if self._started_at else 0.0,
        }


#: the first meshd whose heartbeats are extensible (older ones refuse any field they lack)
EXTENSIBLE_HEARTBEATS_SINCE = (0, 2, 0)


def _version_tuple(version: str) -> tuple[int, ...]:
    """"0.2.0" -> (0, 2, 0); anything unparsable (an unknown peer) -> () (oldest)."""
    try:
        return tuple(int(x) for x in version.split("+")[0].split("."))
    except ValueError:
        return ()


def _meshd_version() -> str:
    from meshd import __version__

    return __version__


def _safe_fp(key: str) -> str:
    try:
        return key_fingerprint(key)
    except Exception:
        return "invalid"
