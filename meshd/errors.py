"""The one error base every package raises for user-facing failures.

The CLI prints these as a single line (no traceback); the daemon turns them
into error replies. Subclass it per domain so callers can be specific.
"""


class MeshdError(Exception):
    """An error whose message is meant for a user or a client."""
