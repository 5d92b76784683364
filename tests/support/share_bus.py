"""Sharing services wired to each other without daemons: a bus for their control messages.

Each service is the real one on a real, allow-listed CURVE transport node; only
the daemon around it is replaced by its ``ShareDeps`` — adverts and targets go
straight to the other services, every member is ready.
"""

from __future__ import annotations

from types import SimpleNamespace

from meshd.mesh.membership import PeerState
from meshd.share.deps import ShareDeps, ShareSettings, share_address
from meshd.share.service import ShareService
from transport.node import TransportNode


class Bus:
    def __init__(self):
        self.services: dict[str, ShareService] = {}
        self.addresses: dict[str, tuple[str, int]] = {}
        self.members: dict[str, SimpleNamespace] = {}
        self.sent: list[tuple[str, str, object]] = []  # (sender, to, message) of every send

    def broadcast(self, sender, msg):
        for nid, svc in list(self.services.items()):
            if nid != sender:
                svc.on_control(sender, msg)
        return len(self.services) - 1

    def send(self, sender, nid, msg):
        self.sent.append((sender, nid, msg))
        if nid in self.services:
            self.services[nid].on_control(sender, msg)
            return True
        return False


async def shell(bus: Bus, tmp_path, name: str, model=None, cls=ShareService, replan_now=None,
                device_ready=None) -> ShareService:
    node = TransportNode(name, state_dir=tmp_path / name)
    await node.start()
    deps = ShareDeps(
        name, ShareSettings(advert_interval_s=0.1, listen="127.0.0.1", model=model),
        tmp_path / name / "models", node, lambda msg: bus.broadcast(name, msg),
        lambda nid, msg: bus.send(name, nid, msg), lambda: sorted(bus.services),
        address_of=lambda nid: share_address(PeerState.READY, bus.addresses.get(nid), bus.members.get(nid)),
        **({"replan_now": replan_now} if replan_now is not None else {}),
        **({"device_ready": device_ready} if device_ready is not None else {}))
    svc = cls(deps)
    await svc.start()
    bus.services[name] = svc
    bus.addresses[name] = ("127.0.0.1", 0)
    bus.members[name] = SimpleNamespace(public_key=node.public_key.decode())
    for other in bus.services.values():  # everyone admits everyone (the home's allow-list)
        for peer in bus.services.values():
            other.deps.transport.admit(peer.deps.transport.public_key, peer.deps.node_id)
    return svc


async def close_all(bus: Bus):
    for svc in bus.services.values():
        await svc.aclose()
        await svc.deps.transport.close()
