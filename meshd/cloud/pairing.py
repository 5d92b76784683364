"""Pairing a home with a cloud verifier: a one-time token, then CURVE like every link.

``meshd cloud invite`` (on the verifier's host) stores a hashed one-time token
and prints it. ``meshd cloud pair ADDRESS TOKEN`` (on any home member) proves
knowledge of the token over a plain TCP exchange — the same challenge/MAC
dance as joining a home (``meshd.mesh.pairing``), nothing secret on the wire — and
sends the public keys of every member of the home. The verifier admits those
keys to its allow-list (so a device not paired is refused at the CURVE
handshake, before it can send a byte of work) and answers with its own public
key, the port of its verification endpoint, its model and the fingerprint of
its tokenizer. The member stores that in ``cloud.json``; its daemon then uses
the verifier for the requests it coordinates. A tokenizer that differs from
the home's is refused at pairing time: token ids would mean different things.

    home  -> cloud   hello     {token_id, home_id, name, keys[], tokenizer, nonce_h}
    cloud -> home    challenge {nonce_c}
    home  -> cloud   proof     {mac = HMAC(k, hello fields, nonce_c)}
    cloud -> home    welcome   {server_key, port, model, tokenizer, mac = HMAC(k, body, nonces)}
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Callable

from meshd.log import get_logger
from meshd.mesh.pairing import (
    MAX_LINE, PAIRING_VERSION, PairingEndpoint, PairingError, Token, _canonical, _mac, _recv, _send)
from meshd.state import StateDir
from transport.errors import KeyStoreError
from transport.keys import validate_public_key

log = get_logger("meshd.cloud.pairing")

MAX_KEYS = 64


def create_cloud_invite(state: StateDir, addresses: list[str], pairing_port: int, ttl_s: float) -> tuple[Token, float]:
    token = Token(secrets.token_bytes(16), state.node_id(), tuple(addresses), pairing_port)
    expires = time.time() + ttl_s
    state.add_invite(token.token_id, token.key.hex(), expires)
    return token, expires


def _hello_fields(hello: dict) -> list[str]:
    keys = hello.get("keys")
    keys = ",".join(map(str, keys)) if isinstance(keys, list) else ""
    return [str(hello.get(k, "")) for k in ("token_id", "home_id", "name", "tokenizer", "nonce")] + [keys]


class CloudPairingServer(PairingEndpoint):
    """The verifier's pairing endpoint. ``info()`` gives {port, model, tokenizer} for the welcome."""

    refused_event = "cloud_pairing_refused"
    failed_event = "cloud_pairing_failed"

    def __init__(self, state: StateDir, info: Callable[[], dict], clock: Callable[[], float] = time.time):
        super().__init__(state, clock)
        self.info = info

    def _admitted(self, result: tuple[str, str, list[str]], remote: str) -> None:
        home, name, keys = result
        log.info("cloud_home_paired", home_id=home[:8], name=name, keys=len(keys), remote=remote)

    async def _pair(self, reader, writer) -> tuple[str, str, list[str]]:
        hello = await _recv(reader)
        if hello.get("op") != "hello" or hello.get("v") != PAIRING_VERSION:
            raise PairingError("expected a pairing hello of version 1")
        fields = _hello_fields(hello)
        tid, home_id, name, tokenizer, nonce_h = fields[:5]
        keys = hello.get("keys")
        if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_KEYS or not home_id or not nonce_h:
            raise PairingError(f"pairing hello needs a home id, a nonce and 1..{MAX_KEYS} member keys")
        for k in keys:
            try:
                validate_public_key(str(k))
            except KeyStoreError as exc:
                raise PairingError(f"pairing hello has an unusable public key ({exc})") from None
        invite = self.state.peek_invite(tid, self.clock())
        if invite is None:
            raise PairingError("invite token is unknown, used or expired")
        key = bytes.fromhex(invite["key"])
        nonce_c = secrets.token_hex(16)
        await _send(writer, {"op": "challenge", "nonce": nonce_c})
        proof = await _recv(reader)
        if proof.get("op") != "proof" or not hmac.compare_digest(str(proof.get("mac", "")),
                                                                  _mac(key, "cloud-pair", *fields, nonce_c)):
            raise PairingError("invite token proof is wrong")
        info = self.info()
        if tokenizer != info["tokenizer"]:
            raise PairingError("the home's model and the verifier's model use different tokenizers "
                               f"(verifier: {info['model']}); pair a home whose model shares its tokenizer")
        if self.state.take_invite(tid, self.clock()) is None:
            raise PairingError("invite token is unknown, used or expired")
        allow = self.state.allow_list()
        for k in keys:  # the invite's id (the verifier's) tells homes apart; a home's own name and id could collide
            allow.add(str(k), f"home {name} ({home_id[:8]}, invite {tid[:8]})")
        body = {"server_key": self.state.keypair().public.decode(), "port": int(info["port"]),
                "model": str(info["model"]), "tokenizer": str(info["tokenizer"])}
        await _send(writer, {"op": "welcome", **body, "mac": _mac(key, "cloud-welcome", _canonical(body),
                                                                     nonce_h, nonce_c)})
        return home_id, name, [str(k) for k in keys]


def admit_home_keys(state: StateDir, sender_key: str, keys: list) -> int:
    """A paired member vouches for its home's keys: admit the new ones under the sender's home.

    Raises ``PairingError`` if the sender was not admitted by a pairing, ``ValueError`` if a key
    is unusable or the home would exceed ``MAX_KEYS``. Returns how many keys were new."""
    allow = state.allow_list()
    label = allow.name_of(sender_key) if sender_key in allow else ""
    if not label.startswith("home "):
        raise PairingError("only a member of a paired home can vouch for its home's keys")
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise ValueError(f"a home has at most {MAX_KEYS} member keys")
    try:
        wanted = {validate_public_key(str(k)) for k in keys}
    except KeyStoreError as exc:
        raise ValueError(f"unusable public key ({exc})") from None
    held = {k for k in allow.keys() if allow.name_of(k) == label}
    fresh = wanted - held
    if not fresh:
        return 0
    taken = [k for k in fresh if k in allow]
    if taken:  # admitted under another home or by the operator: not this home's to vouch for
        raise PairingError(f"{len(taken)} of these keys were admitted for someone else; they cannot be vouched for")
    if len(held | fresh) > MAX_KEYS:
        raise ValueError(f"a home has at most {MAX_KEYS} member keys at the verifier")
    for k in sorted(fresh):
        allow.add(k, label)
    log.info("cloud_home_keys_admitted", home=label, added=len(fresh), total=len(held | fresh))
    return len(fresh)


async def pair_with_cloud(host: str, token: Token, home_id: str, name: str, keys: list[str], tokenizer: str,
                          port: int | None = None, connect_timeout_s: float = 10.0) -> dict:
    """Pair this home with the verifier at ``host`` (its pairing port from the token unless given)."""
    port = token.pairing_port if port is None else port
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=MAX_LINE),
                                                connect_timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise PairingError(f"cannot reach the verifier at {host}:{port} ({exc or type(exc).__name__})") from None
    try:
        nonce_h = secrets.token_hex(16)
        hello = {"op": "hello", "v": PAIRING_VERSION, "token_id": token.token_id, "home_id": home_id,
                 "name": name, "keys": list(keys), "tokenizer": tokenizer, "nonce": nonce_h}
        await _send(writer, hello)
        challenge = await _recv(reader)
        nonce_c = str(challenge.get("nonce", ""))
        if challenge.get("op") != "challenge" or not nonce_c:
            raise PairingError("unexpected reply from the verifier")
        await _send(writer, {"op": "proof", "mac": _mac(token.key, "cloud-pair", *_hello_fields(hello), nonce_c)})
        welcome = await _recv(reader)
        if welcome.get("op") != "welcome":
            raise PairingError("unexpected reply from the verifier")
        body = {k: welcome.get(k) for k in ("server_key", "port", "model", "tokenizer")}
        if not hmac.compare_digest(str(welcome.get("mac", "")),
                                   _mac(token.key, "cloud-welcome", _canonical(body), nonce_h, nonce_c)):
            raise PairingError("the verifier's reply is not authentic (wrong token?)")
        try:
            validate_public_key(str(body["server_key"]))
            vport = int(body["port"])
        except (KeyStoreError, TypeError, ValueError) as exc:
            raise PairingError(f"malformed welcome ({exc})") from None
        return {"address": f"tcp://{host}:{vport}", "server_key": str(body["server_key"]),
                "model": str(body["model"]), "tokenizer": str(body["tokenizer"]), "paired_at": time.time()}
    except (asyncio.TimeoutError, ConnectionError) as exc:
        raise PairingError(f"pairing with {host}:{port} failed ({exc or type(exc).__name__})") from None
    finally:
        writer.close()
