"""The cloud verifier called in-process, behind the interface the home's offload loop talks to; and served
on loopback with a home paired to it through the real handshake."""

import asyncio

import torch

from decoding.loader import open_model
from decoding.offload.local import LocalDrafter
from decoding.offload.loop import OffloadDecoder, VerifierEvicted, VerifierUnavailable, VerifyResult
from decoding.offload.policy import OffloadPolicy
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams, filtered_probs
from meshd.cloud.home import draft_seed
from tests.support.models import build_tiny_checkpoint
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


def tiny_pair(tmp_path_factory) -> tuple:
    """A small and a big tiny model sharing a vocabulary (different weights: they disagree often), as stages."""
    small_dir, big_dir = tmp_path_factory.mktemp("slm"), tmp_path_factory.mktemp("llm")
    build_tiny_checkpoint(small_dir, "llama", seed=3, num_hidden_layers=2)
    build_tiny_checkpoint(big_dir, "llama", seed=4)
    small, big = open_model(small_dir), open_model(big_dir)
    return small.load_stage(0, small.config.num_layers), big.load_stage(0, big.config.num_layers)


def cut_home_model(real_stage, layers: int = 20):
    """The home's model in the real-model tests: the embedded one cut to its first ``layers`` layers (same
    tokenizer, weaker)."""
    from decoding.models.llama import StageModel

    s = real_stage
    return StageModel(s.config, 0, s.config.num_layers, s.layers[:layers], s.embed, s.final_norm, s.lm_head,
                      s.inv_freq, s.dtype)


async def offload_answer(small, verifier, prompt, max_tokens, budget=1.0, sampling=SamplingParams(), session=1,
                         eos=(), drafter=None, **kw):
    """One answer of the home's offload loop drafting with ``small``; (tokens, stats)."""
    own = drafter is None
    drafter = drafter or LocalDrafter(LocalPipeline([small]), sampling if sampling.greedy else SamplingParams(
        sampling.temperature, sampling.top_k, sampling.top_p, draft_seed(sampling.seed or 0)))
    dec = OffloadDecoder(drafter, verifier, OffloadPolicy(budget), session, sampling=sampling,
                         eos_ids=frozenset(eos), seed=0, **kw)
    try:
        out = [t async for t in dec.run(prompt, max_tokens)]
    finally:
        if own:
            drafter.close()
    return out, dec.stats


def first_two_law(big, sampling: SamplingParams, prompt=(5, 6, 7)) -> dict:
    """The big model's exact law of an answer's first two tokens under ``sampling``."""
    pipe = LocalPipeline([big])
    pipe.create("t", 16)
    p1 = filtered_probs(pipe.forward("t", torch.tensor(list(prompt)))[-1], sampling)
    law = {}
    for a in torch.nonzero(p1).flatten().tolist():
        pipe.truncate("t", len(prompt))
        p2 = filtered_probs(pipe.forward("t", torch.tensor([a]))[-1], sampling)
        for b in torch.nonzero(p2).flatten().tolist():
            law[(a, b)] = float(p1[a] * p2[b])
    return law
