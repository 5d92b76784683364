"""Who may use the API: the unix socket and loopback are trusted, LAN listeners need a key.

The unix socket is guarded by file permissions (mode 0660, the meshd group)
and a loopback port only reaches this machine, so neither asks for a key —
unless ``require_keys`` (``--require-keys``) says every TCP listener, loopback
included, needs one: then a user can try the key Home Assistant will send
with curl on the daemon's own machine, and other local users need a key too.
The unix socket never asks (its file mode is its guard; ``meshd status`` and
``meshd chat`` use it). A listener on any other address (``meshd join --http
0.0.0.0:11434``) can be reached by every device on the LAN: each request there
must carry ``Authorization: Bearer <key>`` with a key from ``meshd apikey
create`` (Home Assistant's Ollama and OpenAI integrations send exactly that
header).

The policy is per listener, not per client address: a request that reaches
the LAN port from this machine (a reverse proxy, an SSH tunnel) still needs
the key. Failed attempts are rate-limited per client address, so keys cannot
be guessed at network speed (they could not be anyway: 256 random bits; the
limit mostly keeps a misconfigured client from filling the log).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from meshd.apikeys import ApiKey, ApiKeyStore

# Paths anyone who can reach a listener may use: liveness probes and Ollama's
# "is a server running here?" check. They reveal nothing but "up" or the reason not.
PUBLIC_PATHS = frozenset({"/", "/health", "/api/version"})


@dataclass
class FailureLimiter:
    """At most ``max_failures`` bad keys per ``window_s`` per client; then 429 until it ages out."""

    max_failures: int = 10
    window_s: float = 60.0
    max_clients: int = 4096  # bounded memory under a spray from many addresses
    clock: object = time.monotonic
    _fails: OrderedDict = field(default_factory=OrderedDict)

    def retry_after(self, client: str) -> float | None:
        """Seconds until ``client`` may try again, or None if it may try now."""
        times = self._recent(client)
        if len(times) < self.max_failures:
            return None
        return max(0.1, times[0] + self.window_s - self.clock())

    def failed(self, client: str) -> None:
        times = self._recent(client)
        times.append(self.clock())
        self._fails[client] = times
        self._fails.move_to_end(client)
        while len(self._fails) > self.max_clients:
            self._fails.popitem(last=False)

    def _recent(self, client: str) -> list[float]:
        cutoff = self.clock() - self.window_s
        times = [t for t in self._fails.get(client, ()) if t > cutoff]
        if not times:
            self._fails.pop(client, None)
        return times


class Authenticator:
    """Decides per request whether a key is needed, and whether the one given is valid."""

    def __init__(self, store: ApiKeyStore | None, limiter: FailureLimiter | None = None, *,
                 require_keys: bool = False):
        self.store = store
        self.limiter = limiter or FailureLimiter()
        self.require_keys = require_keys  # every TCP listener needs a key, loopback ones too
        self.keyed_ports: set[int] = set()  # TCP ports of listeners that require a key

    def keyed(self, loopback: bool) -> bool:
        """Whether a TCP listener (on a loopback address or not) asks for keys."""
        return self.require_keys or not loopback

    def requires_key(self, sockname) -> bool:
        """Whether a connection accepted on ``sockname`` (its local address) needs a key."""
        return isinstance(sockname, tuple) and len(sockname) >= 2 and sockname[1] in self.keyed_ports

    def check(self, header: str | None) -> ApiKey | None:
        if not header or self.store is None:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.store.check(token.strip())
