"""The verifier's compute side: one batched forward per pass, then each finished job's verdict.

Runs in the verifier's one compute thread; the scheduler (:mod:`meshd.cloud.verifier`)
picks the batch on the event loop and hands it over. A job is one request of
one session; a long one is run in pieces over several passes (a chunked
fill), and only its last piece, which holds the root and the drafts, yields
logits for the verdict.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoding.batch import BatchItem
from decoding.errors import CacheFull
from decoding.exits.previews import Preview, PreviewExits
from decoding.models import StageModel
from decoding.sampling import Sampler
from decoding.speculative.verify import verify_offloaded
from meshd.cloud.verify_request import Support, VerifierRefusal
from meshd.log import get_logger
from transport.cloud_messages import CloudVerdict, CloudVerify

log = get_logger("meshd.cloud.verifier")

Outcome = tuple[CloudVerdict | None, Exception | None]  # (verdict, refusal); (None, None): a piece of a fill


@dataclass
class Session:
    key: tuple[str, int]
    seq: str
    sampler: Sampler
    capacity: int
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # in the pass running now: its cache may not be freed until the pass ends
    closed: bool = False  # dropped while busy: freed when the pass ends


@dataclass
class Job:
    session: Session
    msg: CloudVerify
    tokens: list[int]
    future: asyncio.Future
    done: int = 0  # tokens already run (a chunked fill)
    support: Support | None = None
    #: Called from the compute thread with each early verdict worth sending (see Worker.run); None: not asked.
    on_preview: Callable[[Preview], None] | None = None

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done


@dataclass
class VerifierStats:
    requests: int = 0
    verified: int = 0
    busy: int = 0
    evicted: int = 0
    bad: int = 0
    superseded: int = 0
    passes: int = 0
    tokens: int = 0  # tokens the model computed
    drafts: int = 0
    accepted: int = 0
    busy_s: float = 0.0
    previews: int = 0  # early verdicts sent to homes
    previews_right: int = 0  # ... that the final verdict then equalled
    batches: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["busy_s"] = round(self.busy_s, 3)
        d["batches"] = {str(k): v for k, v in sorted(self.batches.items())}
        return d


class Worker:
    """Runs passes over the verifier's KV cache; counts what it computed in ``stats``."""

    def __init__(self, stage: StageModel, kv, stats: VerifierStats, chunk: int, previews: PreviewExits | None = None):
        self.stage = stage
        self.kv = kv
        self.stats = stats
        self.chunk = chunk
        self.previews = previews

    def piece(self, job: Job) -> int:
        """Tokens of the job to run in this pass: all of it if it is short; else a chunk that leaves
        the root and the drafts (whose logits the verdict reads) whole for the final piece."""
        tail = job.msg.drafts + 1
        if job.left <= self.chunk + tail:
            return job.left
        return min(self.chunk, job.left - tail)

    def run(self, batch: list[Job]) -> list[Outcome]:
        """One forward for the batch, then each finished job's verdict (compute thread)."""
        items, finals, outs = [], [], [None] * len(batch)
        live, watched, at = [], [], 0  # watched: (job, its drafts' first row in the pass, previews already sent)
        for i, job in enumerate(batch):
            s = job.session
            try:
                if job.done == 0:
                    self._rewind(job)
                n = self.piece(job)
                final = n == job.left
                x = torch.tensor(job.tokens[job.done: job.done + n], dtype=torch.long)
                items.append(BatchItem(s.seq, x, all_logits=final, head=final,
                                       logit_rows=job.msg.drafts + 1 if final else 0))
                finals.append(final)
                live.append(i)
                if final and self._previews_for(job):
                    watched.append((job, at + n - job.msg.drafts - 1, []))
                at += n
            except VerifierRefusal as exc:
                outs[i] = (None, exc)
        if not items:
            return outs
        taps = {layer: self._tap(layer, watched) for layer in self.previews.layers} if watched else None
        try:
            results = self.stage.forward_batch(self.kv, items, taps=taps)
        except CacheFull as exc:
            for i in live:
                outs[i] = (None, VerifierRefusal("busy", f"the verifier's cache is full: {exc}"))
            return outs
        for i, item, out, final in zip(live, items, results, finals):
            job = batch[i]
            job.done += item.tokens
            self.stats.tokens += item.tokens
            if not final:
                outs[i] = (None, None)
                continue
            try:
                outs[i] = (self._verdict(job, out), None)
            except Exception as exc:  # noqa: BLE001 - one job's problem is its own
                outs[i] = (None, VerifierRefusal("bad_request", f"verification failed: {exc}"))
        for job, _, sent in watched:
            verdict = outs[batch.index(job)][0]
            if verdict is not None:
                self.stats.previews_right += sum((p.accepted, p.token) == (verdict.accepted, verdict.token)
                                                 for p in sent)
        return outs

    def _previews_for(self, job: Job) -> bool:
        """A sampled session's previews borrow its next uniforms (a fork of its stream): only a seeded one's."""
        params = job.session.sampler.params
        return (self.previews is not None and job.on_preview is not None and job.msg.previews > 0
                and (params.greedy or params.seed is not None))

    def _preview(self, job: Job, layer: int, rows: torch.Tensor) -> Preview | None:
        d, s = job.msg.drafts, job.session
        if s.sampler.params.greedy:
            return self.previews.verdict(layer, rows, job.tokens[-d:])
        return self.previews.sampled_verdict(layer, rows, job.tokens[-d:], job.tokens[-d - 1], s.sampler.params,
                                             s.sampler.fork().uniform, job.support)

    def _tap(self, layer: int, watched: list) -> Callable[[torch.Tensor], None]:
        """After ``layer``: each watched job's exit verdict, sent when it is sure enough and says something new
        (a deeper exit repeating the last preview adds nothing for the home)."""
        def tap(h: torch.Tensor) -> None:
            for job, first, sent in watched:
                try:
                    p = self._preview(job, layer, h[first:first + job.msg.drafts + 1])
                    if p is None or p.confidence < job.msg.previews / 100 or (
                            sent and (sent[-1].accepted, sent[-1].token) == (p.accepted, p.token)):
                        continue
                    sent.append(p)
                    self.stats.previews += 1
                    job.on_preview(p)
                except Exception:  # noqa: BLE001 - a preview is a hint: its failure must not fail the pass
                    log.error("preview_failed", layer=layer, exc_info=True)
        return tap

    def _rewind(self, job: Job) -> None:
        s, start = job.session, job.msg.start
        have = self.kv.length(s.seq)
        if start > have:
            raise VerifierRefusal("evicted", f"session {job.msg.session} holds {have} positions, the request "
                                             f"starts at {start}; resend it from the start")
        if start < have:
            self.kv.truncate(s.seq, start)

    def _verdict(self, job: Job, logits: torch.Tensor) -> CloudVerdict:
        d = job.msg.drafts
        drafts = job.tokens[-d:]
        root = job.tokens[-d - 1]
        s = job.session
        v = verify_offloaded(drafts, root, logits, s.sampler.params, s.sampler.uniform, job.support)
        # Keep the committed context and the accepted drafts; the verdict's token is not in the cache.
        self.kv.truncate(s.seq, job.msg.start + len(job.tokens) - d + v.accepted)
        self.stats.verified += 1
        self.stats.drafts += d
        self.stats.accepted += v.accepted
        return CloudVerdict(job.msg.session, v.accepted, int(v.next_token), s.sampler.draws)
