"""The verifier's core: per-home sessions on one big model, verified in continuous batches.

A verification is a short partial prefill on a session's cached prefix: the
home's uncached committed tokens, then its drafts. Requests from every home
wait in one bounded queue; each scheduler pass runs all waiting verifications
of distinct sessions in one batched forward (weights read once for all of
them — on every device we target, decode-sized forwards are bound by reading
the weights). A new session's prompt is prefilled in chunks of ``chunk``
tokens, one chunk per pass, next to everyone's verifications: a long prompt
never holds a pass for more than a chunk (Sarathi-style), so it cannot stall
the homes that are mid-answer.

Memory: sessions reserve KV positions out of one budget. A session that does
not fit evicts the least recently used idle ones; the evicted home's next
request gets a clear ``evicted`` error and resends its context. A full queue
answers ``busy`` at once. Both are errors the home handles without losing a
token (it commits the chunk as drafted).

The position a request starts at is the prefix the home *confirmed*; the
session rolls back to it before running, so a verdict the home gave up on
(timeout) never leaves the two sides disagreeing. A newer request for a
session supersedes an older one still queued.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from decoding.errors import CacheFull
from decoding.offload.loop import SUPPORT_MAX
from decoding.sampling import BadSamplingParams, Sampler, SamplingParams
from decoding.speculative.verify import dense_draft_probs, verify_offloaded
from decoding.batch import BatchItem
from decoding.models import StageModel
from meshd.errors import MeshdError
from meshd.log import get_logger
from partition.ids import CloudSession
from transport.messages import CloudVerdict, CloudVerify

log = get_logger("meshd.cloud.verifier")

MAX_DRAFTS = 16
CHUNK = 64  # prompt tokens per pass for a session's (re)fill
MAX_BATCH_TOKENS = 256
DEFAULT_CAPACITY = 1024
MAX_QUEUE = 64
BATCH_HIST_MAX = 32


class VerifierRefusal(MeshdError):
    """A request the verifier answers with an error: ``code`` is busy, evicted, bad_request, ..."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Session:
    key: tuple[str, int]
    seq: str
    sampler: Sampler
    capacity: int
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # in the pass running now: its cache may not be freed until the pass ends
    closed: bool = False  # dropped while busy: freed when the pass ends


@dataclass
class _Job:
    session: _Session
    msg: CloudVerify
    tokens: list[int]
    future: asyncio.Future
    done: int = 0  # tokens already run (a chunked fill)
    support: object = None

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
    batches: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["busy_s"] = round(self.busy_s, 3)
        d["batches"] = {str(k): v for k, v in sorted(self.batches.items())}
        return d


def _unpack_tokens(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise VerifierRefusal("bad_request", "tokens must be uint32 little-endian (length a multiple of 4)")
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def _unpack_support(raw: bytes) -> tuple[list[int], list[float]]:
    if len(raw) % 8 or not raw or len(raw) // 8 > SUPPORT_MAX:
        raise VerifierRefusal("bad_request", f"a draft's distribution is 1..{SUPPORT_MAX} (uint32 id, float32 p) pairs")
    vals = struct.unpack("<" + "If" * (len(raw) // 8), raw)
    return list(vals[0::2]), list(vals[1::2])


class Verifier:
    """Sessions, the queue and the scheduler around one model (all layers, one stage)."""

    def __init__(self, stage: StageModel, *, kv_budget_tokens: int = 16384, max_queue: int = MAX_QUEUE,
                 chunk: int = CHUNK, max_batch_tokens: int = MAX_BATCH_TOKENS, batched: bool = True):
        if not (stage.is_first and stage.is_last):
            raise ValueError("the verifier runs the whole model as one stage")
        self.stage = stage
        self.kv = stage.new_cache(kv_budget_tokens)
        self.max_queue = max_queue
        self.chunk = chunk
        self.max_batch_tokens = max_batch_tokens
        self.batched = batched
        self.stats = VerifierStats()
        self._sessions: OrderedDict[tuple[str, int], _Session] = OrderedDict()  # least recently used first
        self._queue: list[_Job] = []
        self._wake = asyncio.Event()
        self._seq = 0
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="verifier")
        self._task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="verifier-scheduler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(VerifierRefusal("busy", "the verifier is shutting down"))
        self._queue.clear()
        self._compute.shutdown(wait=False, cancel_futures=True)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def status(self) -> dict:
        return {"sessions": self.sessions, "queued": self.queued, "kv_tokens_reserved": self.kv.reserved_tokens,
                "kv_budget_tokens": self.kv.max_tokens, **self.stats.to_dict()}

    # -- requests (event loop) ----------------------------------------------------------
    async def submit(self, home: str, msg: CloudVerify) -> CloudVerdict:
        """Queue a verification and wait for its verdict; raises VerifierRefusal."""
        self.stats.requests += 1
        try:
            job = self._admit(home, msg)
        except VerifierRefusal as exc:
            counter = exc.code if exc.code in ("busy", "evicted") else "bad"
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            log.info("verify_refused", code=exc.code, error=str(exc), home=home[:8], session=msg.session)
            raise
        self._wake.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if job in self._queue:
                self._queue.remove(job)
            raise

    def close_session(self, home: str, session: CloudSession) -> None:
        s = self._sessions.pop((home, int(session)), None)
        if s is not None:
            self._supersede_queued(s)
            self._drop(s)

    def _drop(self, s: _Session) -> None:
        """Free a session's cache now, or when the pass that is using it ends."""
        if s.busy:
            s.closed = True
        else:
            self.kv.free(s.seq)

    def _admit(self, home: str, msg: CloudVerify) -> _Job:
        if len(self._queue) >= self.max_queue:
            raise VerifierRefusal("busy", f"the verifier's queue is full ({self.max_queue} requests); "
                                          "go on locally and retry later")
        tokens = _unpack_tokens(msg.tokens)
        vocab = self.stage.config.vocab_size
        if not 1 <= msg.drafts <= MAX_DRAFTS or len(tokens) < msg.drafts + 1:
            raise VerifierRefusal("bad_request", f"drafts must be 1..{MAX_DRAFTS} and come after at least "
                                                 "one committed token")
        if any(t >= vocab for t in tokens):
            raise VerifierRefusal("bad_request", f"token ids must be below the vocabulary size {vocab}")
        if msg.start < 0 or msg.start + len(tokens) > self.stage.config.max_position:
            raise VerifierRefusal("bad_request", f"positions [{msg.start}, {msg.start + len(tokens)}) do not fit "
                                                 f"the model's context of {self.stage.config.max_position}")
        support = None
        if msg.q is not None:
            if len(msg.q) != msg.drafts:
                raise VerifierRefusal("bad_request", f"q has {len(msg.q)} rows for {msg.drafts} drafts")
            try:
                support = [_unpack_support(row) for row in msg.q]
                dense_draft_probs(support, vocab)  # checked here, on the event loop, not in the pass
            except (ValueError, struct.error) as exc:
                raise VerifierRefusal("bad_request", f"bad draft distribution: {exc}") from None
        key = (home, int(msg.session))
        session = self._sessions.get(key)
        if msg.open is not None:
            session = self._open(key, msg)
        elif session is None:
            raise VerifierRefusal("evicted", f"session {msg.session} is not in the verifier's cache "
                                             "(evicted or never opened); resend it from the start")
        self._sessions.move_to_end(key)
        session.last_used = time.monotonic()
        self._supersede_queued(session)
        job = _Job(session, msg, tokens, asyncio.get_running_loop().create_future(), support=support)
        self._queue.append(job)
        return job

    def _supersede_queued(self, session: _Session) -> None:
        """Fail the session's waiting requests: a newer one (or the session's end) replaces them."""
        for job in [j for j in self._queue if j.session is session]:
            self._queue.remove(job)
            if not job.future.done():
                self.stats.superseded += 1
                job.future.set_exception(VerifierRefusal("superseded", "a newer request for this session arrived"))

    def _open(self, key: tuple[str, int], msg: CloudVerify) -> _Session:
        spec = msg.open or {}
        unknown = set(spec) - {*SamplingParams().to_dict(), "draws", "capacity"}
        if unknown:
            raise VerifierRefusal("bad_request", f"open: unknown field(s) {sorted(unknown)}")
        if msg.start != 0:
            raise VerifierRefusal("bad_request", "a session opens at position 0")
        try:
            params = SamplingParams.from_dict(spec)
            draws = int(spec.get("draws", 0))
            cap = int(spec.get("capacity", DEFAULT_CAPACITY))
        except (TypeError, ValueError, BadSamplingParams) as exc:
            raise VerifierRefusal("bad_request", f"open: {exc}") from None
        if not 0 <= draws <= 1 << 24:
            raise VerifierRefusal("bad_request", "open: draws out of range")
        tokens = len(msg.tokens) // 4
        cap = max(min(cap, self.stage.config.max_position), tokens + MAX_DRAFTS + 1)
        old = self._sessions.pop(key, None)
        if old is not None:  # reopened (the home resends after a timeout or an eviction)
            self._supersede_queued(old)
            self._drop(old)
        self._make_room(cap)
        self._seq += 1
        seq = f"v{self._seq}"
        try:
            self.kv.create(seq, cap)
        except CacheFull:
            raise VerifierRefusal("busy", f"the verifier's cache cannot hold {cap} more positions now") from None
        s = _Session(key, seq, Sampler(params, skip=draws), cap)
        self._sessions[key] = s
        return s

    def _make_room(self, need: int) -> None:
        """Evict least recently used idle sessions until ``need`` positions fit the budget."""
        waiting = {id(j.session) for j in self._queue}
        for key in list(self._sessions):
            if self.kv.reserved_tokens + need <= self.kv.max_tokens:
                return
            s = self._sessions[key]
            if s.busy or id(s) in waiting:
                continue
            del self._sessions[key]
            self._drop(s)
            log.info("session_evicted", home=key[0][:8], session=key[1], positions=s.capacity)

    # -- the scheduler ---------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._pick()
            for job in batch:
                job.session.busy = True
            t = time.perf_counter()
            try:
                outcomes = await loop.run_in_executor(self._compute, self._pass, batch)
            except Exception as exc:  # noqa: BLE001 - a bug in a pass must not stop the verifier
                log.error("verify_pass_failed", error=f"{type(exc).__name__}: {exc}", jobs=len(batch), exc_info=True)
                outcomes = [(None, VerifierRefusal("internal", f"the verification failed: {type(exc).__name__}"))
                            ] * len(batch)
                for job in batch:
                    job.done = len(job.tokens)  # do not retry it
            finally:
                for job in batch:
                    job.session.busy = False
                    if job.session.closed:
                        job.session.closed = False
                        self.kv.free(job.session.seq)
            self.stats.busy_s += time.perf_counter() - t
            self.stats.passes += 1
            size = min(len(batch), BATCH_HIST_MAX)
            self.stats.batches[size] = self.stats.batches.get(size, 0) + 1
            for job, (result, exc) in zip(batch, outcomes):
                if job.left > 0 and exc is None:
                    continue  # a chunked fill: it stays queued for the next pass
                if job in self._queue:
                    self._queue.remove(job)
                if job.future.done():
                    continue
                if exc is not None:
                    job.future.set_exception(exc)
                else:
                    job.future.set_result(result)

    def _pick(self) -> list[_Job]:
        """This pass: every waiting verification (distinct sessions), plus one fill chunk."""
        batch, seen, tokens, filling = [], set(), 0, False
        for job in self._queue:
            if id(job.session) in seen:
                continue
            size = self._piece(job)
            fill = size < job.left
            if fill and filling:
                continue
            if batch and tokens + size > self.max_batch_tokens:
                continue
            batch.append(job)
            seen.add(id(job.session))
            tokens += size
            filling = filling or fill
            if not self.batched:
                break
        return batch

    def _piece(self, job: _Job) -> int:
        """Tokens of the job to run in this pass: all of it if it is short; else a chunk that leaves
        the root and the drafts (whose logits the verdict reads) whole for the final piece."""
        tail = job.msg.drafts + 1
        if job.left <= self.chunk + tail:
            return job.left
        return min(self.chunk, job.left - tail)

    def _pass(self, batch: list[_Job]) -> list[tuple[CloudVerdict | None, Exception | None]]:
        """One forward for the batch, then each finished job's verdict (compute thread)."""
        items, finals, outs = [], [], [None] * len(batch)
        live = []
        for i, job in enumerate(batch):
            s = job.session
            try:
                if job.done == 0:
                    self._rewind(job)
                n = self._piece(job)
                final = n == job.left
                x = torch.tensor(job.tokens[job.done: job.done + n], dtype=torch.long)
                items.append(BatchItem(s.seq, x, all_logits=final, head=final,
                                       logit_rows=job.msg.drafts + 1 if final else 0))
                finals.append(final)
                live.append(i)
            except VerifierRefusal as exc:
                outs[i] = (None, exc)
        if not items:
            return outs
        try:
            results = self.stage.forward_batch(self.kv, items)
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
        return outs

    def _rewind(self, job: _Job) -> None:
        s, start = job.session, job.msg.start
        have = self.kv.length(s.seq)
        if start > have:
            raise VerifierRefusal("evicted", f"session {job.msg.session} holds {have} positions, the request "
                                             f"starts at {start}; resend it from the start")
        if start < have:
            self.kv.truncate(s.seq, start)

    def _verdict(self, job: _Job, logits: torch.Tensor) -> CloudVerdict:
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
