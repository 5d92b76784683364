"""Transport: zero-copy tensor messages over ZeroMQ, encrypted with CurveZMQ.

Modules, one job each:

- ``wire``      header schema, tensor (de)serialisation, limits, ``ProtocolError``
- ``messages``  typed message dataclasses + the one ``encode``/``decode``
- ``keys``      the home's keypair store and allow-list
- ``auth``      ZAP authenticator admitting allow-listed keys
- ``link``      ``StageServer`` (ROUTER) on asyncio: receives, queues, replies
- ``peer``      ``Peer`` (DEALER): the client of one server
- ``node``      ``TransportNode``: one context + keys + authenticator per daemon
- ``loop``      uvloop when available
"""

from transport.errors import (
    AuthenticationRefused,
    KeyStoreError,
    ProtocolError,
    RemoteError,
    TransportClosed,
    TransportError,
    TransportTimeout,
)
from transport.keys import AllowList, Keypair, fingerprint, load_or_create_keypair
from transport.link import Endpoint, Request, StageServer
from transport.messages import Envelope, decode, encode, message
from transport.node import TransportNode
from transport.peer import Peer
from transport.wire import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits

__all__ = [
    "AllowList",
    "AuthenticationRefused",
    "DEFAULT_LIMITS",
    "Endpoint",
    "Envelope",
    "Keypair",
    "KeyStoreError",
    "Limits",
    "PROTOCOL_VERSION",
    "Peer",
    "ProtocolError",
    "RemoteError",
    "Request",
    "StageServer",
    "TransportClosed",
    "TransportError",
    "TransportNode",
    "TransportTimeout",
    "decode",
    "encode",
    "fingerprint",
    "load_or_create_keypair",
    "message",
]
