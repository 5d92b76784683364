"""The engine as the API sees it while the daemon runs: one that shutdown can drain.

Kept apart from the model host so the one rule it enforces reads on its own: new requests
are refused once shutdown starts, and running ones are cut with a clear message once the
drain timeout passes, instead of a connection reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from meshd.engine.base import Engine, GenerationRequest, TokenStream
from meshd.engine.errors import EngineUnavailable
from meshd.errors import MeshdError
from meshd.log import get_logger

log = get_logger("meshd.daemon")

SHUTDOWN_MESSAGE = "meshd is shutting down on this device; retry the request"


class DaemonError(MeshdError):
    pass


class DrainingEngine(Engine):
    """Wraps the real engine so shutdown can refuse new requests and cut running ones.

    ``draining``: new requests fail at once with 503 ``engine_unavailable``.
    ``aborting``: running ones fail at their next token with the same clear
    message (in-band for streams), instead of a connection reset.
    """

    def __init__(self, inner: Engine):
        self.inner = inner
        self.draining = False
        self.aborting = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    model_id = property(lambda self: self.inner.model_id)
    source = property(lambda self: getattr(self.inner, "source", None))
    vocab_size = property(lambda self: getattr(self.inner, "vocab_size", None))
    context_length = property(lambda self: self.inner.context_length)
    tokenizer = property(lambda self: self.inner.tokenizer)
    capabilities = property(lambda self: self.inner.capabilities)

    def token_ids(self, req: GenerationRequest) -> TokenStream:
        return TokenStream.relay(self.inner.token_ids(req), self._guarded)  # the inner engine's stats ride along

    async def _guarded(self, inner: AsyncIterator[int]) -> AsyncIterator[int]:
        if self.draining:
            raise EngineUnavailable(SHUTDOWN_MESSAGE)
        self.in_flight += 1
        self.idle.clear()
        try:
            async with contextlib.aclosing(inner) as ids:
                async for tid in ids:
                    if self.aborting:
                        raise EngineUnavailable(SHUTDOWN_MESSAGE + " (the request was cut short)")
                    yield tid
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; give running ones ``timeout_s`` to finish, then cut them."""
        self.draining = True
        if not self.in_flight:
            return
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain_timeout", cutting=self.in_flight)
            self.aborting = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.idle.wait(), 5.0)


def load_engine_factory(spec: str) -> Callable[..., Any]:
    """``module:attr`` -> the callable (the seam for the pipeline engine and test fakes)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise DaemonError(f"engine must be 'module:factory', got {spec!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise DaemonError(f"cannot load engine {spec!r}: {exc}") from None
