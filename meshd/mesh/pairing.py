"""Home pairing with one-time invite tokens.

``meshd invite`` (on a member) creates a token: a random secret plus the
addresses of the member's pairing endpoint. The member's state keeps only
hashes of the secret and an expiry. ``meshd join --token T`` (on the new
device) connects to that endpoint and both sides prove knowledge of the secret
without sending it:

    joiner -> member   hello     {token_id, node_id, name, public_key, nonce_j}
    member -> joiner   challenge {nonce_m}
    joiner -> member   proof     {mac = HMAC(k, joiner's hello fields, nonce_j, nonce_m)}
    member -> joiner   welcome   {home_id, home_name, members[], mac = HMAC(k, body, nonces)}

``k`` is derived from the secret; the token is consumed when the proof checks
out, so a token admits exactly one device. The joiner trusts the member list
because only a holder of the token could MAC it; the member trusts the new
public key for the same reason. The pairing channel is plain TCP: nothing on it
is secret (public keys, the home id), it only has to be authentic.

A token admits a *new* device; it never lets one take over a member. A hello
whose node id is already in the home with another key (or whose key already
belongs to another node id) is refused after the proof checks out, with an
error the joiner prints, and logged on the member (``pairing_identity_conflict``).
Such a refusal does not consume the token: the holder proved it has the token,
so leaving it usable admits nothing it could not already add (one new device
until the expiry), while a person who ran ``meshd join --token`` on a cloned
state directory can fix that and retry without a new invite. Re-pairing the
same node id with the same key is a no-op that succeeds (and consumes the token).

Wire format: one JSON object per line, at most ``MAX_LINE`` bytes.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.state import Home, Member, MemberConflict, StateDir, key_fingerprint, member_conflict
from transport.errors import KeyStoreError
from transport.keys import validate_public_key

log = get_logger("meshd.mesh.pairing")

TOKEN_PREFIX = "meshd1-"
PAIRING_VERSION = 1
MAX_LINE = 64 * 1024
IO_TIMEOUT_S = 10.0


class PairingError(MeshdError):
    """Pairing failed: bad/expired/used token, unreachable member, tampered reply."""


# --------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Token:
    secret: bytes
    node_id: str  # the inviting member
    addresses: tuple[str, ...]
    pairing_port: int

    @property
    def token_id(self) -> str:
        return token_id(self.secret)

    @property
    def key(self) -> bytes:
        return token_key(self.secret)

    def encode(self) -> str:
        body = {"s": base64.urlsafe_b64encode(self.secret).decode().rstrip("="),
                "n": self.node_id, "a": list(self.addresses), "p": self.pairing_port}
        raw = json.dumps(body, separators=(",", ":")).encode()
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @staticmethod
    def decode(text: str) -> Token:
        text = text.strip()
        if not text.startswith(TOKEN_PREFIX):
            raise PairingError("not a meshd invite token (it should start with 'meshd1-')")
        try:
            raw = text[len(TOKEN_PREFIX):]
            body = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
            s = body["s"]
            secret = base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
            return Token(secret, str(body["n"]), tuple(map(str, body["a"])), int(body["p"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise PairingError("malformed invite token: it starts like one but does not decode; paste the "
                               "whole first line `meshd invite` printed (it may have been cut or wrapped)") from None


def token_id(secret: bytes) -> str:
    return hashlib.sha256(b"meshd-invite-id\0" + secret).hexdigest()[:16]


def token_key(secret: bytes) -> bytes:
    return hashlib.sha256(b"meshd-invite-key\0" + secret).digest()


def create_invite(
    state: StateDir, node_id: str, addresses: list[str], pairing_port: int,
    ttl_s: float, now: float | None = None,
) -> tuple[Token, float]:
    """Store a new one-time invite (hashed) and return the token and its expiry time."""
    if state.home() is None:
        raise PairingError("this device is not in a home yet: it enters one with 'meshd join --token TOKEN' "
                           "(or, on a home's first device only, 'meshd join --new-home NAME')")
    token = Token(secrets.token_bytes(16), node_id, tuple(addresses), pairing_port)
    expires = (time.time() if now is None else now) + ttl_s
    state.add_invite(token.token_id, token.key.hex(), expires)
    return token, expires


def _mac(key: bytes, label: str, *parts: str) -> str:
    msg = "\0".join((label, *parts)).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------- framing


async def _send(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> dict:
    line = await asyncio.wait_for(reader.readline(), IO_TIMEOUT_S)
    if not line:
        raise PairingError("connection closed during pairing")
    if len(line) > MAX_LINE:
        raise PairingError("pairing message too long")
    try:
        obj = json.loads(line)
    except ValueError:
        raise PairingError("pairing message is not JSON") from None
    if not isinstance(obj, dict):
        raise PairingError("pairing message is not an object")
    if obj.get("op") == "error":
        raise PairingError(str(obj.get("error", "refused")))
    return obj


# --------------------------------------------------------------------------- member side


class PairingEndpoint:
    """A TCP endpoint running one token handshake per connection (a home's, a cloud verifier's).

    Subclasses implement ``_pair`` (the handshake; raises PairingError to refuse) and
    ``_admitted`` (what follows a success); a refusal is logged and sent to the peer.
    """

    refused_event = "pairing_refused"
    failed_event = "pairing_failed"

    def __init__(self, state: StateDir, clock: Callable[[], float] = time.time):
        self.state = state
        self.clock = clock
        self.server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._handle, host, port, limit=MAX_LINE)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    async def _pair(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        raise NotImplementedError

    def _admitted(self, result, remote: str) -> None:
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            self._admitted(await self._pair(reader, writer), str(peer))
        except (PairingError, asyncio.TimeoutError, ConnectionError, ValueError) as exc:
            log.warning(self.refused_event, remote=str(peer), error=str(exc) or type(exc).__name__)
            try:
                await _send(writer, {"op": "error", "error": str(exc) or "refused"})
            except (ConnectionError, RuntimeError):
                pass
        except Exception:
            log.exception(self.failed_event, remote=str(peer))
        finally:
            writer.close()


class PairingServer(PairingEndpoint):
    """The member's pairing endpoint. ``on_admitted(member)`` runs after each success."""

    def __init__(self, state: StateDir, on_admitted: Callable[[Member], None],
                 clock: Callable[[], float] = time.time):
        super().__init__(state, clock)
        self.on_admitted = on_admitted

    def _admitted(self, member: Member, remote: str) -> None:
        log.info("pairing_admitted", new_node=member.node_id, new_name=member.name, remote=remote)
        self.on_admitted(member)

    async def _pair(self, reader, writer) -> Member:
        hello = await _recv(reader)
        if hello.get("op") != "hello" or hello.get("v") != PAIRING_VERSION:
            raise PairingError("expected a pairing hello of version 1")
        fields = [str(hello.get(k, "")) for k in ("token_id", "node_id", "name", "public_key", "nonce")]
        tid, node_id, name, public_key, nonce_j = fields
        if len(public_key) != 40 or not node_id or not nonce_j:
            raise PairingError("pairing hello is missing fields")
        try:
            validate_public_key(public_key)
        except KeyStoreError as exc:
            raise PairingError(f"pairing hello has an unusable public key ({exc})") from None
        invite = self.state.peek_invite(tid, self.clock())
        home = self.state.home()
        if invite is None or home is None:
            raise PairingError("invite token is unknown, used or expired")
        key = bytes.fromhex(invite["key"])
        nonce_m = secrets.token_hex(16)
        await _send(writer, {"op": "challenge", "nonce": nonce_m})
        proof = await _recv(reader)
        expect = _mac(key, "join", *fields, nonce_m)
        if proof.get("op") != "proof" or not hmac.compare_digest(str(proof.get("mac", "")), expect):
            raise PairingError("invite token proof is wrong")
        member = Member(node_id, name, public_key)
        # Checked once the proof is good (a stranger learns nothing) and before the
        # token is consumed (see the module docstring); add_members checks again
        # under the state lock, so a race cannot slip a key swap through.
        self._refuse_conflict(member_conflict(self.state.members(), member))
        if self.state.take_invite(tid, self.clock()) is None:  # one-time: lost a race
            raise PairingError("invite token is unknown, used or expired")
        try:
            self.state.add_members([member])
        except MemberConflict as exc:
            self._refuse_conflict(exc)
        body = {
            "home_id": home.home_id,
            "home_name": home.name,
            "members": [m.to_json() for m in self.state.members().values()],
        }
        mac = _mac(key, "welcome", _canonical(body), nonce_j, nonce_m)
        await _send(writer, {"op": "welcome", **body, "mac": mac})
        return member

    @staticmethod
    def _refuse_conflict(conflict: MemberConflict | None) -> None:
        if conflict is None:
            return
        log.warning("pairing_identity_conflict", node_id=conflict.offered.node_id,
                    offered_name=conflict.offered.name,
                    offered_fingerprint=key_fingerprint(conflict.offered.public_key),
                    member_node_id=conflict.existing.node_id, member_name=conflict.existing.name,
                    member_fingerprint=key_fingerprint(conflict.existing.public_key))
        raise PairingError(f"refused by the inviting device: {conflict}")


# --------------------------------------------------------------------------- joiner side


async def join_with_token(
    token: Token, node_id: str, name: str, public_key: str, connect_timeout_s: float = 5.0
) -> tuple[Home, list[Member]]:
    """Pair with the member named in ``token``; returns the home and its members."""
    errors = []
    for address in token.addresses:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(address, token.pairing_port, limit=MAX_LINE),
                connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            errors.append(f"{address}:{token.pairing_port}: {exc or type(exc).__name__}")
            continue
        try:
            return await _join_on(reader, writer, token, node_id, name, public_key)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            errors.append(f"{address}:{token.pairing_port}: {exc or type(exc).__name__}")
        finally:
            writer.close()
    raise PairingError("cannot reach the inviting device (" + "; ".join(errors) + "). Is its daemon running "
                       "and reachable from here? The token names the pairing port that device had when "
                       "`meshd invite` ran; if it has restarted on another port since, run `meshd invite` "
                       "there again for a fresh token")


async def _join_on(reader, writer, token: Token, node_id, name, public_key):
    nonce_j = secrets.token_hex(16)
    fields = [token.token_id, node_id, name, public_key, nonce_j]
    await _send(writer, {"op": "hello", "v": PAIRING_VERSION, "token_id": fields[0],
                         "node_id": node_id, "name": name, "public_key": public_key,
                         "nonce": nonce_j})
    challenge = await _recv(reader)
    nonce_m = str(challenge.get("nonce", ""))
    if challenge.get("op") != "challenge" or not nonce_m:
        raise PairingError("unexpected reply from the inviting device")
    await _send(writer, {"op": "proof", "mac": _mac(token.key, "join", *fields, nonce_m)})
    welcome = await _recv(reader)
    if welcome.get("op") != "welcome":
        raise PairingError("unexpected reply from the inviting device")
    body = {k: welcome.get(k) for k in ("home_id", "home_name", "members")}
    expect = _mac(token.key, "welcome", _canonical(body), nonce_j, nonce_m)
    if not hmac.compare_digest(str(welcome.get("mac", "")), expect):
        raise PairingError("the inviting device's reply is not authentic (wrong token?)")
    try:
        members = [Member.from_json(m) for m in body["members"]]
        home = Home(str(body["home_id"]), str(body["home_name"]))
    except (KeyError, TypeError) as exc:
        raise PairingError(f"malformed welcome ({exc})") from None
    return home, members
