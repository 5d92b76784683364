"""Who gets in: mDNS adverts and sightings, pairing, and connecting to members found.

mDNS only *finds* devices; a sighting is admitted when its advert names this home and a
key the allow-list holds (``meshd.mesh.discovery.classify``). Pairing grows the allow-list;
gossip then tells every member. Liveness is not decided here: heartbeats do that.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from typing import Any

from meshd.config import Config
from meshd.mesh.discovery import PROTOCOL_VERSION, REASON_UNREACHABLE, Advert, Discovery, Sighting, classify
from meshd.log import get_logger
from meshd.mesh.membership import PeerState
from meshd.mesh.gossip import Gossip
from meshd.mesh.view import MeshView
from meshd.mesh.pairing import PairingServer
from meshd.state import Member, atomic_write, key_fingerprint

log = get_logger("meshd.admission")

LAST_PAIRING_PORT_FILE = "pairing_port"  # kept across restarts: tokens name this port


class Admission:
    def __init__(self, config: Config, view: MeshView, gossip: Gossip, clock: Callable[[], float]):
        self.config = config
        self.view = view
        self.gossip = gossip
        self.clock = clock
        self.sightings: dict[str, Sighting] = {}
        self.discovery: Discovery | None = None
        self.pairing: PairingServer | None = None

    @property
    def link(self):
        return self.gossip.link

    # -- pairing ---------------------------------------------------------------------------
    async def start_pairing(self) -> int:
        """Listen for pairing. With ``--pairing-port 0`` the port this state dir had last time comes
        first: invite tokens name it, and one minted before a restart should still work."""
        cfg = self.config
        self.pairing = PairingServer(self.view.state, self.on_admitted)
        remembered = self.view.state.root / LAST_PAIRING_PORT_FILE
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
        self.view.local.pairing_port = port
        return port

    def on_admitted(self, member: Member) -> None:
        """Pairing admitted a device: tell every member its key (they admit it too)."""
        self.view.reload_members()
        if self.link is not None:
            self.link.broadcast(self.gossip.member_list())
        self.reclassify()

    # -- mDNS --------------------------------------------------------------------------------
    async def start_discovery(self) -> None:
        self.discovery = Discovery(self.advert(), self.view.interfaces, self.classify, self.on_sighting)
        await self.discovery.start()

    async def stop_discovery(self) -> None:
        """Withdraw the mDNS record."""
        if self.discovery is not None:
            try:
                await self.discovery.stop()
            except Exception:  # noqa: BLE001 - shutting down: nothing left to tell
                pass
            self.discovery = None

    async def stop_pairing(self) -> None:
        if self.pairing is not None:
            await self.pairing.stop()
            self.pairing = None

    def advert(self) -> Advert:
        local, home = self.view.local, self.view.home
        return Advert(
            node_id=local.node_id, name=local.name, protocol_version=PROTOCOL_VERSION,
            home_digest=home.digest if home else "", key_fingerprint=key_fingerprint(local.public_key),
            memory_budget_mb=local.memory_budget_mb, profile_digest=local.profile_digest(),
            port=local.port, pairing_port=local.pairing_port,
        )

    def classify(self, advert: Advert) -> str | None:
        home = self.view.home
        return classify(advert, self.view.node_id, home.digest if home else None, self.view.members)

    def on_sighting(self, sighting: Sighting, removed: bool) -> None:
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
            asyncio.ensure_future(self.admit(adv, sighting.addresses))

    def reclassify(self) -> None:
        """The allow-list changed: sightings refused as "unpaired" may now be admissible."""
        for s in list(self.sightings.values()):
            if s.advert is None:
                continue
            reason = self.classify(s.advert)
            if reason != s.reason:
                s.reason = reason
                if reason is None:
                    asyncio.ensure_future(self.admit(s.advert, s.addresses))

    def pick_address(self, addresses: tuple[str, ...]) -> str | None:
        """Prefer an address on one of our own subnets (the one we can route to)."""
        if not addresses:
            return None
        ours = [ipaddress.IPv4Address(a) for i in self.view.interfaces for a in i.addresses]
        for a in addresses:
            ip = ipaddress.IPv4Address(a)
            if any(ip == o or (ip.packed[:3] == o.packed[:3]) for o in ours):
                return a
        return addresses[0]

    async def admit(self, adv: Advert, addresses: tuple[str, ...]) -> None:
        member = self.view.members.get(adv.node_id)
        address = self.pick_address(addresses)
        if member is None or address is None or self.link is None:
            return
        self.view.addresses[adv.node_id] = (address, adv.port)
        try:
            await self.link.connect(adv.node_id, member.public_key, address, adv.port)
        except Exception as exc:
            log.warning("peer_connect_failed", peer=adv.node_id, error=str(exc))
            return
        self.gossip.apply(self.view.membership.observe(adv.node_id, self.clock()))
        self.gossip.send_heartbeat(adv.node_id)

    def not_admitted(self, now: float) -> list[dict[str, Any]]:
        """Sightings this device did not (or could not) admit, each with its reason."""
        out = []
        for s in self.sightings.values():
            reason, adv = s.reason, s.advert
            if reason is None and adv is not None:
                st = self.view.state_of(adv.node_id)
                overdue = now - self.view.local.started_at > self.config.gone_after_s
                if st is PeerState.GONE or (st in (None, PeerState.JOINING) and overdue):
                    reason = REASON_UNREACHABLE
            if reason is not None:
                out.append({
                    "name": adv.name if adv else s.instance, "node_id": adv.node_id if adv else None,
                    "address": f"{s.addresses[0]}:{s.port}" if s.addresses else None,
                    "reason": reason,
                })
        return sorted(out, key=lambda d: (d["reason"], str(d["name"])))
