"""The cloud verifier called in-process, behind the interface the home's offload loop talks to."""

import asyncio

from decoding.offload.loop import VerifierEvicted, VerifierUnavailable, VerifyResult
from meshd.cloud.link import to_message
from meshd.cloud.verifier import Verifier, VerifierRefusal


class InProcess:
    """The real verifier, called directly; its refusals mapped as the CURVE link maps them."""

    available = True

    def __init__(self, verifier: Verifier, home: str = "home-a", turns: asyncio.Lock | None = None):
        self.v, self.home, self.sent, self.turns = verifier, home, [], turns

    async def verify(self, req, timeout_s=None):
        msg = to_message(req)
        self.sent.append(msg)
        try:
            if self.turns is not None:  # homes taking turns: a session is idle whenever another opens
                async with self.turns:
                    r = await self.v.submit(self.home, msg)
            else:
                r = await self.v.submit(self.home, msg)
        except VerifierRefusal as exc:
            raise (VerifierEvicted if exc.code == "evicted" else VerifierUnavailable)(str(exc)) from None
        return VerifyResult(r.accepted, r.token, r.draws)

    async def close_session(self, session):
        self.v.close_session(self.home, session)
