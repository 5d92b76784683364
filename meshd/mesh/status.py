"""The status document (``GET /v1/mesh/status``, ``meshd status``): the home as this device sees it.

Built on each request from the objects that own each part; the parts above the control
plane (the engine, this device's stage, model sharing) come in as small callables, so
this module needs none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshd.config import Config
from meshd.mesh.discovery import PROTOCOL_VERSION
from meshd.mesh.admission import Admission
from meshd.mesh.gossip import safe_fingerprint
from meshd.mesh.local import meshd_version
from meshd.mesh.planner import Planner
from meshd.mesh.view import MeshView
from meshd.model.self_profile import describe as describe_profile
from partition.ids import NodeId


class StatusDocument:
    """``engine()``: the API's engine (None until one is loaded); ``stage_status()``: this
    device's stage (None without one); ``sharing_status()``; ``ready()``: a request would start
    at once; ``draining()``: shutting down; ``link_status()``: per linked member's round trips."""

    def __init__(self, config: Config, view: MeshView, planner: Planner, admission: Admission,
                 clock: Callable[[], float], *, engine: Callable[[], Any], stage_status: Callable[[], dict | None],
                 sharing_status: Callable[[], dict | None], ready: Callable[[], bool],
                 draining: Callable[[], bool], link_status: Callable[[], dict[str, dict[str, Any]]]):
        self.config = config
        self.view = view
        self.planner = planner
        self.admission = admission
        self.clock = clock
        self.engine = engine
        self.stage_status = stage_status
        self.sharing_status = sharing_status
        self.ready = ready
        self.draining = draining
        self.link_status = link_status

    def links(self, stage: dict | None) -> dict[str, dict[str, Any]]:
        """Per linked member: round trip (``rtt_s``, None unless fresh), ``age_s``, ``reachable``;
        ``bytes_sent``: activation bytes this device's stage sent it."""
        links = self.link_status()
        for nid, n in ((stage or {}).get("activation_bytes_to") or {}).items():
            links.setdefault(nid, {})["bytes_sent"] = n
        return links

    def member(self, nid: NodeId, now: float, stage: dict | None) -> dict[str, Any]:
        view, local, plan = self.view, self.view.local, self.view.plan
        layers = plan.layers_of(nid) if plan else None
        if nid == view.node_id:
            state, last_seen, budget = "ready", 0.0, self.config.memory_budget_mb
            address = view.interfaces[0].addresses[0] if view.interfaces else None
            port = local.port
            info = {"version": meshd_version(), "uptime_s": round(now - local.started_at, 1),
                    "model": local.model_identity()[0],
                    "kv_tokens": (stage or {}).get("kv_tokens_in_use"), "last_error": local.last_error}
        else:
            peer = view.membership.peers.get(nid)
            state = peer.state.value if peer else "offline"
            last_seen = round(now - peer.last_seen, 3) if peer else None
            budget = peer.info.get("memory_budget_mb") if peer else None
            address, port = view.addresses.get(nid, (None, None))
            info = peer.info if peer else {}
        return {
            "node_id": nid, "name": view.members[nid].name, "state": state, "self": nid == view.node_id,
            "address": f"{address}:{port}" if address else None,
            "memory_budget": budget, "layers": list(layers) if layers else None,
            "last_seen_s": last_seen, "fingerprint": safe_fingerprint(view.members[nid].public_key),
            "version": info.get("version") or None, "uptime_s": info.get("uptime_s"),
            "model_digest": (info.get("model") or "").rpartition("@")[2] or None,
            "kv_tokens": info.get("kv_tokens"), "last_error": info.get("last_error") or None,
            "profile": describe_profile(view.profile_of(nid)),
        }

    def document(self) -> dict[str, Any]:
        now = self.clock()
        view, local, plan = self.view, self.view.local, self.view.plan
        stage = self.stage_status()
        engine = self.engine()
        members = view.members
        return {
            "node_id": view.node_id,
            "name": self.config.name,
            "home": {"name": view.home.name, "digest": view.home.digest} if view.home else None,
            "state": "draining" if self.draining() else "serving",
            "protocol_version": PROTOCOL_VERSION,
            "ports": {"transport": local.port, "pairing": local.pairing_port},
            "members": [self.member(nid, now, stage) for nid in sorted(members)],
            "not_admitted": self.admission.not_admitted(now),
            "interfaces": [{"name": i.name, "addresses": list(i.addresses)} for i in view.interfaces],
            "plan": plan.to_status() if plan else None,
            "replans": self.planner.replans,
            "model": engine.model_id if engine else None,
            "model_identity": local.model_identity()[0] or None,
            "load_state": local.load_state,
            "profile": local.profile_how,
            "numeric_mode": local.mode_how or None,
            "ready": self.ready(),
            "not_planned": [{"node_id": n, "name": members[n].name if n in members else None,
                             "reason": r} for n, r in sorted(self.planner.not_planned().items())],
            "stage": stage,
            "links": self.links(stage),
            "sharing": self.sharing_status(),
            "requests_in_flight": engine.in_flight if engine else 0,
            "recent": {"tokens_per_s": None, "ttft_s": None},
            "version": meshd_version(),
            "uptime_s": local.uptime_s(),
        }
