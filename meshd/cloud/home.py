"""The home's use of a paired cloud verifier: one link, the offload policies, the totals.

The daemon builds it from ``cloud.json`` (``meshd cloud pair``) once its
transport is up; the pipeline engine asks it for a decoder per request. One
:class:`~decoding.offload.policy.OffloadPolicy` per budget is shared by the
requests that use that budget, so the importance percentile behind the budget
learns from all of them.
"""

from __future__ import annotations

import itertools
import secrets

from decoding.offload.loop import OffloadDecoder, OffloadStats, PreviewSettings
from decoding.offload.policy import OffloadPolicy
from decoding.sampling import SamplingParams
from meshd.cloud.link import CloudLink
from meshd.log import get_logger
from partition.ids import CloudSession
from transport.cloud_messages import CloudMembers
from transport.messages import Ack

log = get_logger("meshd.cloud.home")


def draft_seed(seed: int) -> int:
    """The drafter's own random stream: rejection sampling is exact only if the drafts are drawn
    independently of the verifier's uniforms (which follow the request's seed)."""
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % (1 << 63)


class CloudHome:
    def __init__(self, link: CloudLink, budget: float = 0.2, model: str = "", previews: PreviewSettings | None = None):
        self.link = link
        self.budget = budget
        self.model = model
        self.previews = previews
        self._policies: dict[float, OffloadPolicy] = {}
        self._sessions = itertools.count(secrets.randbits(30))
        self.totals = {"requests": 0, "chunks": 0, "offloaded": 0, "verified": 0, "accepted": 0, "drafted": 0,
                       "local_fallbacks": 0, "tokens": 0, "previews": 0, "predrafts": 0, "predraft_rounds": 0,
                       "predraft_hits": 0, "predraft_saved_s": 0.0}

    @classmethod
    async def connect(cls, node, info: dict, budget: float, min_timeout_s: float | None = None,
                      previews: PreviewSettings | None = None) -> "CloudHome":
        peer = await node.connect(info["address"], server_key=info["server_key"])
        log.info("cloud_verifier_paired", address=info["address"], model=info.get("model"), budget=budget)
        kw = {} if min_timeout_s is None else {"min_timeout_s": min_timeout_s}
        home = cls(CloudLink(peer, info["address"], **kw), budget, str(info.get("model", "")), previews)
        if previews is not None:
            home.link.offers_previews()  # ask the verifier now, not at the first answer
        return home

    async def admit(self, keys: list[str], timeout_s: float) -> int:
        """Vouch for the home's member keys at the verifier; returns how many it had not admitted yet."""
        reply = await self.link.peer.request(CloudMembers(list(keys)), timeout=timeout_s)
        if not isinstance(reply, Ack):
            raise ValueError(f"the verifier answered {type(reply).__name__} to the home's keys")
        return int(reply.detail or 0)

    @staticmethod
    def samplings(sampling: SamplingParams) -> tuple[SamplingParams, SamplingParams]:
        """(the verifier's sampling, the drafter's) for one answer: a seeded stream for each, the
        drafter's independent of the verifier's uniforms (rejection sampling is exact only then)."""
        if not sampling.greedy and sampling.seed is None:
            sampling = sampling.with_seed(secrets.randbits(63))
        return sampling, sampling if sampling.greedy else sampling.with_seed(draft_seed(sampling.seed))

    def policy(self, budget: float | None) -> OffloadPolicy:
        b = round(self.budget if budget is None else float(budget), 2)  # one policy per percent, at most 101
        if b not in self._policies:
            self._policies[b] = OffloadPolicy(b)
        return self._policies[b]

    def decoder(self, drafter, sampling: SamplingParams, eos_ids, budget: float | None = None) -> OffloadDecoder:
        self.totals["requests"] += 1
        return OffloadDecoder(drafter, self.link, self.policy(budget), CloudSession(next(self._sessions) % (1 << 31)),
                              sampling=sampling, eos_ids=frozenset(eos_ids), seed=sampling.seed,
                              previews=self.previews)

    def record(self, stats: OffloadStats, tokens: int) -> None:
        t = self.totals
        for k in ("chunks", "offloaded", "verified", "accepted", "drafted", "local_fallbacks", "previews", "predrafts",
                  "predraft_rounds", "predraft_hits", "predraft_saved_s"):
            t[k] += getattr(stats, k)
        t["tokens"] += tokens

    def status(self) -> dict:
        t = dict(self.totals)
        t["share_offloaded"] = round(t["offloaded"] / t["chunks"], 3) if t["chunks"] else 0.0
        t["predraft_hit_rate"] = round(t["predraft_hits"] / t["predraft_rounds"], 3) if t["predraft_rounds"] else 0.0
        t["predraft_saved_s"] = round(t["predraft_saved_s"], 3)
        pv = self.previews
        return {"model": self.model, "budget": self.budget, "link": self.link.status(), "totals": t,
                "previews": {"max_predrafts": pv.max_predrafts, "threshold": pv.threshold} if pv else None,
                "policies": {str(b): p.to_dict() for b, p in self._policies.items()}}

    async def close(self) -> None:
        try:
            await self.link.peer.close()
        except Exception:  # noqa: BLE001 - closing on shutdown
            pass
