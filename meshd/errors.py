"""The one error base every meshd package raises for user-facing failures.

The CLI prints these as a single line (no traceback); the daemon turns them
into error replies. Subclass it per domain so callers can be specific.

The lower layers (``transport``, ``partition``, ``decoding``) never import
``meshd``: each has its own base error. ``USER_ERRORS`` lists all of them, and
is what meshd catches wherever a failure is meant for a user or a client.
"""

from decoding.errors import DecodingError
from partition.errors import PartitionError
from transport.errors import TransportError


class MeshdError(Exception):
    """An error whose message is meant for a user or a client."""


#: Every user-facing error base, meshd's and the lower layers'. Catch this (not
#: ``MeshdError`` alone) where a one-line message or an error reply is expected.
USER_ERRORS: tuple[type[Exception], ...] = (MeshdError, TransportError, PartitionError, DecodingError)


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, USER_ERRORS)


__all__ = ["MeshdError", "USER_ERRORS", "is_user_error", "DecodingError", "PartitionError", "TransportError"]
