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

Previews (the early-exit edge–cloud paper): with exit heads inside the model
(:class:`~decoding.exits.previews.PreviewExits`), a greedy request that asks for
them gets each exit's verdict on its drafts as soon as that exit's layer has run
and the verdict is sure enough — the home drafts the next round from it while
the last layers run. The final verdict is computed as without them: previews
never change what is committed.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from decoding.errors import CacheFull
from decoding.exits.previews import Preview, PreviewExits
from decoding.models import StageModel
from decoding.sampling import Sampler
from meshd.cloud.verify_request import VerifierRefusal, checked, session_open
from meshd.cloud.verify_worker import Job, Session, VerifierStats, Worker
from meshd.log import get_logger
from partition.ids import CloudSession
from transport.cloud_messages import CloudVerdict, CloudVerify

log = get_logger("meshd.cloud.verifier")

CHUNK = 64  # prompt tokens per pass for a session's (re)fill
MAX_BATCH_TOKENS = 256
MAX_QUEUE = 64
BATCH_HIST_MAX = 32


class Verifier:
    """Sessions, the queue and the scheduler around one model (all layers, one stage)."""

    def __init__(self, stage: StageModel, *, kv_budget_tokens: int = 16384, max_queue: int = MAX_QUEUE,
                 chunk: int = CHUNK, max_batch_tokens: int = MAX_BATCH_TOKENS, batched: bool = True,
                 previews: PreviewExits | None = None):
        if not (stage.is_first and stage.is_last):
            raise ValueError("the verifier runs the whole model as one stage")
        self.stage = stage
        self.kv = stage.new_cache(kv_budget_tokens)
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self.batched = batched
        self.stats = VerifierStats()
        self.worker = Worker(stage, self.kv, self.stats, chunk, previews)
        self.preview_layers = previews.layers if previews is not None else []
        self._sessions: OrderedDict[tuple[str, int], Session] = OrderedDict()  # least recently used first
        self._queue: list[Job] = []
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
    async def submit(self, home: str, msg: CloudVerify,
                     on_preview: Callable[[Preview], None] | None = None) -> CloudVerdict:
        """Queue a verification and wait for its verdict; raises VerifierRefusal. ``on_preview`` (called on the
        event loop) receives the early verdicts the request asked for (``msg.previews``), before the verdict."""
        self.stats.requests += 1
        try:
            job = self._admit(home, msg)
        except VerifierRefusal as exc:
            counter = exc.code if exc.code in ("busy", "evicted") else "bad"
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            log.info("verify_refused", code=exc.code, error=str(exc), home=home[:8], session=msg.session)
            raise
        if on_preview is not None and self.preview_layers:
            loop = asyncio.get_running_loop()
            job.on_preview = lambda p: loop.call_soon_threadsafe(on_preview, p)  # from the compute thread
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

    def _drop(self, s: Session) -> None:
        """Free a session's cache now, or when the pass that is using it ends."""
        if s.busy:
            s.closed = True
        else:
            self.kv.free(s.seq)

    def _admit(self, home: str, msg: CloudVerify) -> Job:
        if len(self._queue) >= self.max_queue:
            raise VerifierRefusal("busy", f"the verifier's queue is full ({self.max_queue} requests); "
                                          "go on locally and retry later")
        tokens, support = checked(msg, self.stage.config.vocab_size, self.stage.config.max_position)
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
        job = Job(session, msg, tokens, asyncio.get_running_loop().create_future(), support=support)
        self._queue.append(job)
        return job

    def _supersede_queued(self, session: Session) -> None:
        """Fail the session's waiting requests: a newer one (or the session's end) replaces them."""
        for job in [j for j in self._queue if j.session is session]:
            self._queue.remove(job)
            if not job.future.done():
                self.stats.superseded += 1
                job.future.set_exception(VerifierRefusal("superseded", "a newer request for this session arrived"))

    def _open(self, key: tuple[str, int], msg: CloudVerify) -> Session:
        asked = session_open(msg, self.stage.config.max_position)
        old = self._sessions.pop(key, None)
        if old is not None:  # reopened (the home resends after a timeout or an eviction)
            self._supersede_queued(old)
            self._drop(old)
        self._make_room(asked.capacity)
        self._seq += 1
        seq = f"v{self._seq}"
        try:
            self.kv.create(seq, asked.capacity)
        except CacheFull:
            raise VerifierRefusal("busy", f"the verifier's cache cannot hold {asked.capacity} more positions "
                                          "now") from None
        s = Session(key, seq, Sampler(asked.params, skip=asked.draws), asked.capacity)
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
                outcomes = await loop.run_in_executor(self._compute, self.worker.run, batch)
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

    def _pick(self) -> list[Job]:
        """This pass: every waiting verification (distinct sessions), plus one fill chunk."""
        batch, seen, tokens, filling = [], set(), 0, False
        for job in self._queue:
            if id(job.session) in seen:
                continue
            size = self.worker.piece(job)
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
