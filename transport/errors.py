"""Errors raised by the transport layer.

They all derive from ``TransportError``; the transport never imports ``meshd``
(the layer above lists ``TransportError`` among its user-facing errors, so the
CLI still prints them as one line and the daemon turns them into ``ErrorReply``
messages). They are kept in one small module so that ``wire``, ``link`` and
``keys`` can raise them without importing each other.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base for every failure of the transport layer."""


class ProtocolError(TransportError):
    """A message that does not follow the wire format (or cannot be encoded).

    ``call_id`` is the link-level request id of the offending message when the
    header was readable enough to recover it, so the receiver can still send an
    error reply that the sender matches to its pending request; 0 otherwise.
    """

    code = "protocol"

    def __init__(self, message: str, *, call_id: int = 0) -> None:
        super().__init__(message)
        self.call_id = call_id


class TransportTimeout(TransportError, TimeoutError):
    """No reply arrived in time. Also a ``TimeoutError`` for generic callers."""


class RemoteError(TransportError):
    """The remote side answered with an ``ErrorReply``.

    ``code`` is the machine-readable category (``protocol``, ``handler``,
    ``unknown_type``...), ``message`` the remote's explanation.
    """

    def __init__(self, code: str, message: str, *, peer: str = "") -> None:
        where = f" from {peer}" if peer else ""
        super().__init__(f"remote error{where} [{code}]: {message}")
        self.code = code
        self.remote_message = message
        self.peer = peer


class AuthenticationRefused(TransportError):
    """The server refused our CURVE key (it is not in the home's allow-list)."""


class KeyStoreError(TransportError):
    """A key file or allow-list entry is missing, unreadable or malformed."""


class TransportClosed(TransportError):
    """The link was closed while a request was waiting for its reply."""
