"""mDNS discovery: advertise this daemon as ``_meshd._tcp.local.`` and browse for peers.

Discovery only *finds* candidates; it never admits anyone. Every service found
is classified against this device's home and allow-list: a peer of the same
home whose key is on the allow-list becomes a candidate that the daemon then
contacts over the CURVE transport (which refuses unknown keys anyway); anything
else is recorded with the reason it was not admitted, so ``meshd status`` can
explain why a device in the room is not part of the mesh.

TXT record (all values short ASCII, read by other meshd versions too)::

    id    node id               pv    protocol version
    home  hash of the home id   fp    public-key fingerprint
    mem   memory budget (MiB)   prof  profile digest
    name  device name           pp    pairing port (invites)
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import ifaddr
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.state import Member, key_fingerprint

SERVICE_TYPE = "_meshd._tcp.local."
PROTOCOL_VERSION = 1

log = get_logger("meshd.mesh.discovery")


class DiscoveryError(MeshdError):
    pass


# --------------------------------------------------------------------------- TXT records


@dataclass(frozen=True)
class Advert:
    """What one daemon says about itself over mDNS."""

    node_id: str
    name: str
    protocol_version: int
    home_digest: str
    key_fingerprint: str
    memory_budget_mb: int
    profile_digest: str
    port: int
    pairing_port: int
    addresses: tuple[str, ...] = ()

    def txt(self) -> dict[str, str]:
        return {
            "id": self.node_id,
            "name": self.name[:60],
            "pv": str(self.protocol_version),
            "home": self.home_digest,
            "fp": self.key_fingerprint,
            "mem": str(self.memory_budget_mb),
            "prof": self.profile_digest,
            "pp": str(self.pairing_port),
        }

    @staticmethod
    def from_txt(
        props: dict[bytes | str, bytes | str | None], port: int, addresses: tuple[str, ...]
    ) -> Advert:
        """Parse a TXT record; raises ValueError on anything missing or malformed."""

        def get(key: str, default: str | None = None) -> str:
            for k, v in props.items():
                kk = k.decode() if isinstance(k, bytes) else k
                if kk == key and v is not None:
                    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
            if default is None:
                raise ValueError(f"TXT record has no {key!r}")
            return default

        return Advert(
            node_id=get("id"),
            name=get("name", ""),
            protocol_version=int(get("pv")),
            home_digest=get("home"),
            key_fingerprint=get("fp"),
            memory_budget_mb=int(get("mem", "0")),
            profile_digest=get("prof", ""),
            port=int(port),
            pairing_port=int(get("pp", "0")),
            addresses=addresses,
        )


def instance_name(node_id: str) -> str:
    return f"meshd-{node_id}.{SERVICE_TYPE}"


# --------------------------------------------------------------------------- classification

# Reasons shown by ``meshd status`` for a device that mDNS saw but the mesh did not admit.
REASON_OTHER_HOME = "another home"
REASON_UNPAIRED = "unpaired key"
REASON_PROTOCOL = "protocol version"
REASON_UNREACHABLE = "port unreachable"
REASON_BAD_ADVERT = "malformed advertisement"


def classify(
    advert: Advert, self_id: str, home_digest: str | None, members: dict[str, Member]
) -> str | None:
    """None if ``advert`` is an admissible peer of our home, else the reason it is not.

    The key check compares fingerprints: a device that reuses a member's node id
    with another key is still "unpaired".
    """
    if advert.protocol_version != PROTOCOL_VERSION:
        return f"{REASON_PROTOCOL} {advert.protocol_version} (this daemon speaks {PROTOCOL_VERSION})"
    if home_digest is None or advert.home_digest != home_digest:
        return REASON_OTHER_HOME
    member = members.get(advert.node_id)
    if member is None or key_fingerprint(member.public_key) != advert.key_fingerprint:
        return REASON_UNPAIRED
    return None


# --------------------------------------------------------------------------- interfaces


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...]  # IPv4 addresses


def list_interfaces() -> list[Interface]:
    out = []
    for adapter in ifaddr.get_adapters():
        v4 = tuple(str(ip.ip) for ip in adapter.ips if isinstance(ip.ip, str))
        if v4:
            out.append(Interface(adapter.nice_name, v4))
    return out


def select_interfaces(choice: str | None, available: list[Interface] | None = None) -> list[Interface]:
    """Interfaces to advertise on: ``choice`` is an interface name or one of its IPs.

    Without a choice every non-loopback interface is used, or loopback alone
    when nothing else exists (a laptop with Wi-Fi off still works for itself).
    """
    available = list_interfaces() if available is None else available
    if choice:
        for iface in available:
            if choice == iface.name:
                return [iface]
            if choice in iface.addresses:
                return [Interface(iface.name, (choice,))]
        try:
            ipaddress.IPv4Address(choice)
        except ValueError:
            names = ", ".join(i.name for i in available) or "none"
            raise DiscoveryError(f"no network interface {choice!r} (have: {names})") from None
        raise DiscoveryError(f"no local interface has address {choice}")
    real = [
        i for i in available if not all(ipaddress.IPv4Address(a).is_loopback for a in i.addresses)
    ]
    return real or [i for i in available if i.addresses]


# --------------------------------------------------------------------------- the service


@dataclass
class Sighting:
    """A service seen on the network (admitted or not)."""

    instance: str
    advert: Advert | None
    reason: str | None  # None: admissible
    addresses: tuple[str, ...] = ()
    port: int = 0
    extra: dict = field(default_factory=dict)


class Discovery:
    """Registers our advert and reports every sighting to ``on_change``.

    ``on_change(sighting, removed)`` is called on the event loop for each
    service added/updated (removed=False) or gone (removed=True). Our own
    advert is filtered out.
    """

    def __init__(
        self,
        advert: Advert,
        interfaces: list[Interface],
        classify_fn: Callable[[Advert], str | None],
        on_change: Callable[[Sighting, bool], None],
    ):
        self.advert = advert
        self.interfaces = interfaces
        self.classify_fn = classify_fn
        self.on_change = on_change
        self.addresses = [a for i in interfaces for a in i.addresses]
        self.aiozc: AsyncZeroconf | None = None
        self.browser: AsyncServiceBrowser | None = None
        self.info: AsyncServiceInfo | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    async def start(self) -> None:
        self.aiozc = AsyncZeroconf(interfaces=self.addresses, ip_version=IPVersion.V4Only)
        self.info = AsyncServiceInfo(
            SERVICE_TYPE,
            instance_name(self.advert.node_id),
            addresses=[socket.inet_aton(a) for a in self.addresses],
            port=self.advert.port,
            properties=self.advert.txt(),
            server=f"meshd-{self.advert.node_id}.local.",
        )
        await self.aiozc.async_register_service(self.info, allow_name_change=False)
        self.browser = AsyncServiceBrowser(
            self.aiozc.zeroconf, [SERVICE_TYPE], handlers=[self._on_service_state_change]
        )
        log.info("mdns_registered", instance=self.info.name, addresses=self.addresses,
                 port=self.advert.port)

    async def update(self, advert: Advert) -> None:
        """Re-announce with new TXT values (e.g. the profile digest changed)."""
        self.advert = advert
        if self.aiozc is None or self.info is None:
            return
        self.info = AsyncServiceInfo(
            SERVICE_TYPE, self.info.name, addresses=self.info.addresses, port=advert.port,
            properties=advert.txt(), server=self.info.server,
        )
        await self.aiozc.async_update_service(self.info)

    async def stop(self) -> None:
        """Unregister (sends goodbye packets so peers drop us at once) and close."""
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        if self.browser is not None:
            await self.browser.async_cancel()
        if self.aiozc is not None:
            try:
                await self.aiozc.async_unregister_all_services()
            finally:
                await self.aiozc.async_close()
        self.aiozc = None
        log.info("mdns_unregistered")

    # -- browsing -----------------------------------------------------------
    def _on_service_state_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if self._closing or name == instance_name(self.advert.node_id):
            return
        if state_change is ServiceStateChange.Removed:
            self._safe_callback(Sighting(name, None, None), True)
            return
        task = asyncio.ensure_future(self._resolve(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        assert self.aiozc is not None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self.aiozc.zeroconf, 3000):
            log.debug("mdns_unresolved", instance=name)
            return
        addresses = tuple(info.parsed_addresses(IPVersion.V4Only))
        try:
            advert = Advert.from_txt(info.properties or {}, info.port or 0, addresses)
        except (ValueError, TypeError) as exc:
            sighting = Sighting(name, None, f"{REASON_BAD_ADVERT}: {exc}", addresses, info.port or 0)
        else:
            if advert.node_id == self.advert.node_id:
                return
            sighting = Sighting(name, advert, self.classify_fn(advert), addresses, advert.port)
        self._safe_callback(sighting, False)

    def _safe_callback(self, sighting: Sighting, removed: bool) -> None:
        try:
            self.on_change(sighting, removed)
        except Exception:  # a bug in a handler must not kill discovery
            log.exception("discovery_handler_failed", instance=sighting.instance)
