"""The cloud verifier called in-process, behind the interface the home's offload loop talks to; and served
on loopback with a home paired to it through the real handshake."""

import asyncio

from decoding.offload.loop import VerifierEvicted, VerifierUnavailable, VerifyResult
from decoding.speculative.draft_model import tokenizer_fingerprint
from meshd.cloud.link import CloudLink, to_message
from meshd.cloud.pairing import create_cloud_invite, pair_with_cloud
from meshd.cloud.service import VerifierService
from meshd.cloud.verifier import Verifier, VerifierRefusal
from meshd.mesh.pairing import Token
from meshd.state import StateDir
from transport.node import TransportNode


class InProcess:
    """The real verifier, called directly; its refusals mapped as the CURVE link maps them."""

    available = True

    def __init__(self, verifier: Verifier, home: str = "home-a", turns: asyncio.Lock | None = None):
        self.v, self.home, self.sent, self.turns = verifier, home, [], turns

    def offers_previews(self) -> bool:
        return bool(self.v.preview_layers)

    async def verify(self, req, timeout_s=None, on_preview=None):
        msg = to_message(req)
        self.sent.append(msg)
        try:
            if self.turns is not None:  # homes taking turns: a session is idle whenever another opens
                async with self.turns:
                    r = await self.v.submit(self.home, msg, on_preview)
            else:
                r = await self.v.submit(self.home, msg, on_preview)
        except VerifierRefusal as exc:
            raise (VerifierEvicted if exc.code == "evicted" else VerifierUnavailable)(str(exc)) from None
        return VerifyResult(r.accepted, r.token, r.draws)

    async def close_session(self, session):
        self.v.close_session(self.home, session)


async def serve_verifier(real_source, real_stage, tmp_path, port=0, **kw) -> VerifierService:
    svc = VerifierService(real_source, tmp_path / "cloud", listen="127.0.0.1", port=port, pairing_port=0,
                          stage=real_stage, **kw)
    return await svc.start()


async def paired_home(svc: VerifierService, real_source, tmp_path, name="home", min_timeout_s=30.0):
    """A home paired through the real handshake: (its node, its link to the verifier, the pairing's answer).
    The verdict timeout's floor is long by default: these tests check exactness, and the suite runs them
    with both cores busy."""
    state = StateDir(tmp_path / name).ensure()
    home = state.create_home(name)
    token, _ = create_cloud_invite(svc.state, ["127.0.0.1"], svc.pairing_port, 60)
    info = await pair_with_cloud("127.0.0.1", Token.decode(token.encode()), home.home_id, name,
                                 [state.keypair().public.decode()], tokenizer_fingerprint(real_source.tokenizer))
    node = TransportNode(name, keypair=state.keypair(), allowlist=state.allow_list())
    await node.start()
    peer = await node.connect(info["address"], server_key=info["server_key"], timeout=5.0)
    return node, CloudLink(peer, info["address"], min_timeout_s=min_timeout_s), info
