"""Transport: zero-copy tensor messages over ZeroMQ, encrypted with CurveZMQ.

Modules, one job each:

- ``wire``      the format: header schema, dtypes, limits; encoding frames
- ``wire_decode`` frames back: the header checked first, tensors over the frame's memory
- ``hints``     a header field's type hint: checked at registration, enforced on decode
- ``registry``  ``@message``: a frozen dataclass becomes a wire message
- ``messages``  the envelope, the one ``encode``/``decode``, the link's own messages
- ``stage_messages`` the stage protocol (``StageForward``, ``TokenResult``, ...)
- ``cloud_messages`` the cloud verifier's compact messages
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
from transport.messages import Envelope, decode, encode
from transport.node import TransportNode
from transport.peer import Peer
from transport.registry import message
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
