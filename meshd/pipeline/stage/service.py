"""Serve this device's pipeline stage over the transport.

One service per daemon, and a thin one: it checks messages against the plan it deployed and hands
them to the stage's parts — the :class:`~meshd.pipeline.stage.scheduler.StageScheduler` (slots, the
KV cache, batching), the :class:`~meshd.pipeline.stage.worker.StageWorker` (the forward in the
compute thread), the :class:`~meshd.pipeline.stage.sampler.StageSampler` (the last stage's tokens)
and the :class:`~meshd.pipeline.stage.outbox.StageOutbox` (the result on to the next stage or back
to the coordinator).

**The stage owns its step**, in the shape of vLLM's engine core: the transport only receives
messages and queues them (``transport.link.StageServer.inbox``); the stage's loop takes what queued
and runs :meth:`StageService.step` over it — *schedule* (which messages share a pass, each admitted
to its slot), *execute* (one forward in the compute thread) and *update* (slots released, results
sent on, failures reported). Frees and probes skip the queue (:meth:`StageService.handle`).

Messages are handled strictly in arrival order: chunk j+1 of a prompt needs chunk j's keys/values in
the cache, and a rollback must land before the next forward. While the compute thread works on one
pass, the next messages queue, and the previous result is already travelling to the next stage —
that overlap is the intra-sequence pipeline.

**One error path.** Whatever a message raises — a stale plan, a full cache, a malformed tensor, an
unreachable next stage, a bug — the coordinator named in it gets an ``ErrorReply`` at once, naming
the node that failed, and the sequence is freed (and tombstoned) here: a request that failed on one
stage is dead everywhere.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import torch

from decoding.device import dtype_name
from decoding.models import StageModel
from decoding.tensor_group import GroupLost
from meshd.log import get_logger
from meshd.mesh.caps import Cap, PeerCaps
from meshd.pipeline.links import Directory
from meshd.pipeline.route import Route, model_mismatch
from meshd.pipeline.seqkey import coordinator_of
from meshd.pipeline.stage.errors import StageError
from meshd.pipeline.stage.outbox import StageOutbox
from meshd.pipeline.stage.progress import PROGRESS_EVERY_S, ProgressReporter
from meshd.pipeline.stage.prefix_cache import CacheKey, PrefixCache
from meshd.pipeline.stage.sampler import StageSampler
from meshd.pipeline.stage.scheduler import MAX_BATCH_TOKENS, StageScheduler
from meshd.pipeline.stage.stats import StageStats
from meshd.pipeline.stage.worker import StageWorker, Work
from partition.ids import NodeId, SeqKey
from transport.link import Request, StageServer
from transport.messages import Ack, ErrorReply, Hello, HelloReply
from transport.stage_messages import (
    CacheSequence,
    ForkSequence,
    FreeSequence,
    PrefixMatch,
    PrefixProbe,
    ReusePrefix,
    StageForward,
    TokenResult,
    Truncate,
)
from transport.node import TransportNode

log = get_logger("meshd.stage")

__all__ = ["StageService"]


class StageService:
    def __init__(self, node: TransportNode, node_id: NodeId, model_source, directory: Directory,
                 dtype: torch.dtype | None = None, max_kv_tokens: int = 1 << 16,
                 activation_dtype: str | None = None, send_timeout_s: float = 5.0,
                 idle_seq_timeout_s: float = 300.0, medusa=None, max_batch_tokens: int = MAX_BATCH_TOKENS,
                 device: torch.device | None = None, packed: str = "",
                 peer_caps: Callable[[NodeId], PeerCaps] | None = None, prefix_cache: PrefixCache | None = None,
                 exits=None, progress_every_s: float = PROGRESS_EVERY_S):
        """``device``/``dtype``/``packed``/``exits``: see :class:`StageWorker`; ``medusa``: see :class:`StageSampler`;
        ``prefix_cache``: finished requests' KV kept for later ones (default: half the KV budget).
        ``peer_caps``: what a member's daemon decodes (``meshd.mesh.caps``), so an error names the failed
        node, and a readiness reply the exit layers, only to coordinators that read them (None: every
        peer runs this code). ``progress_every_s``: how often a long step tells the coordinators waiting
        on it that it advances (:mod:`meshd.pipeline.stage.progress`)."""
        self.node = node
        self.node_id = node_id
        self.source = model_source
        self.activation_dtype = activation_dtype
        self.stats = StageStats()
        self.scheduler = StageScheduler(self.stats, max_kv_tokens, max_batch_tokens, idle_seq_timeout_s,
                                        prefix_cache)
        self.worker = StageWorker(model_source, device, dtype, packed, exits)
        self.sampler = StageSampler(model_source, medusa)
        self.route: Route | None = None
        self.index: int | None = None
        self.model_mismatch = ""  # the current plan names another model than this stage's file holds
        self.group_bind = ""  # where a tensor group's links bind, when a plan seats this device in one
        self.outbox = StageOutbox(node, node_id, directory, self.stats, activation_dtype, send_timeout_s,
                                  peer_caps)
        self.progress = ProgressReporter(node_id, self.outbox, progress_every_s)
        self.server: StageServer | None = None
        self._deploy_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []  # the reaper and the progress reporter, for the stage's life

    # -- lifecycle --------------------------------------------------------------
    async def start(self, address: str = "tcp://127.0.0.1:0") -> str:
        # Frees and readiness probes overtake queued chunks: a hung-up request stops
        # costing compute at once, and a probe is not stuck behind a long prefill.
        self.server = await self.node.serve(self.handle, address, ordered=True,
                                            urgent=lambda m: isinstance(m, (FreeSequence, CacheSequence, Hello,
                                                                            PrefixProbe)),
                                            lane=self._steps)
        queued, done = self.server.queued, lambda: self.stage.work_done if self.stage is not None else 0
        self._tasks = [asyncio.create_task(self.scheduler.reap_forever(lambda: self.progress.held_seqs(queued())),
                                           name="stage-reaper"),
                       asyncio.create_task(self.progress.run_forever(done, queued), name="stage-progress")]
        return self.server.address

    async def _steps(self, server: StageServer) -> None:
        """The stage's loop (the server's ordered lane): take what queued, step, answer every message."""
        while True:
            reqs = await self.scheduler.take(server.inbox)
            await server.answer(reqs, self.step)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.outbox.close()
        if self.server is not None:
            await self.server.close()
        await self.worker.aclose()

    def take_groups_at(self, address: str) -> None:
        """Plans may seat this device in a tensor group: its links bind at ``address`` (tcp://host:port)."""
        self.group_bind = address

    @property
    def serving_version(self) -> int:
        """The plan version whose layers are loaded and served here (0: none)."""
        return self.route.plan_version if self.route is not None and self.stage is not None else 0

    async def deploy(self, route: Route) -> None:
        """Adopt a new plan: load this node's layer range (reusing weights if unchanged).

        Every plan change drops all sequences: their caches were built under the
        old partition; their coordinators replay them on the new plan.
        """
        async with self._deploy_lock:
            if self.route is not None and route.plan_version <= self.route.plan_version:
                log.info("stage_plan_ignored", plan_version=route.plan_version,
                         serving=self.route.plan_version)
                return
            idx = route.index_of(self.node_id)
            rng = route.stages[idx].layers if idx is not None else None
            seat = route.group_seat(self.node_id)
            self.model_mismatch = model_mismatch(route.model, str(getattr(self.source, "identity", "") or "")) \
                if route.model else ""
            if self.model_mismatch and rng is not None:
                log.warning("stage_model_mismatch", plan_version=route.plan_version, error=self.model_mismatch)
                rng = None  # never load another model's layer range from this file
            await self.worker.leave_group()
            if seat is not None and not self.model_mismatch:
                await self.worker.take_seat(route, seat, self.node.keypair, self.group_bind)
            elif rng is None:
                self.worker.unload()
            elif not self.worker.holds(rng, route):
                await self.worker.load(rng, route)
            key = CacheKey.of(str(getattr(self.source, "identity", "") or ""), self.worker.stage, self.mode, route, idx,
                              self.activation_dtype)
            self.scheduler.reset(self.worker.stage, len(route.stages), key)
            self.sampler.reset()
            self.route, self.index = route, idx

    # -- what the daemon, status and tests read ----------------------------------------
    @property
    def stage(self) -> StageModel | None:
        """The layers served here (None: none in the current plan, or loading)."""
        return self.worker.stage

    @property
    def kv(self):
        return self.scheduler.kv

    @property
    def mode(self) -> str:
        """The numeric mode this stage computes in now."""
        return self.worker.mode

    def kv_tokens_in_use(self) -> int:
        return self.scheduler.tokens_in_use()

    def sequences(self) -> list[SeqKey]:
        return self.scheduler.sequences()

    def foreign_sequences(self) -> int:
        """Sequences other daemons coordinate through this stage (SIGTERM drains them)."""
        return sum(1 for s in self.sequences() if coordinator_of(s) != self.node_id)

    def warm_grammar(self) -> None:
        """The grammar engine set up in the background, after the warm-up request (whose GIL it would take)."""
        stage = self.worker.stage
        if stage is not None and stage.lm_head is not None:
            self.sampler.warm_grammar(stage)

    def status(self) -> dict[str, Any]:
        stage = self.stage
        return {"plan_version": self.serving_version,
                "layers": [stage.first, stage.end] if stage is not None else None,
                "sequences": len(self.sequences()), "kv_tokens_in_use": self.kv_tokens_in_use(),
                "prefix_cache": self.scheduler.prefix.status(),
                "kv_tokens_max": self.scheduler.max_kv_tokens, "device": str(self.worker.device),
                "dtype": dtype_name(self.worker.dtype), "weights": self.mode,
                "exit_layers": self.worker.exit_layers, **({"exits_note": self.worker.exits_note}
                                                            if self.worker.exits_note else {}),
                "progress_reports": self.progress.sent, **self.stats.to_dict()}

    # -- message handling ------------------------------------------------------------
    async def handle(self, msg: Any, req: Request | None = None) -> Any:
        """One message on its own: the urgent lane's (frees, probes), and a control message between passes."""
        try:
            match msg:
                case Hello():  # readiness probe: which plan is loaded and serving here
                    refused = self._refusal(msg.plan_version)
                    # a coordinator on an older meshd would refuse the whole reply with a field it lacks
                    reads = self.outbox.reads(msg.node_id, Cap.EXITS)
                    return HelloReply(self.node_id, self.serving_version, "", accepted=not refused, reason=refused,
                                      exits=len(self.worker.exit_layers) if reads else 0)
                case StageForward():
                    return (await self.step([msg]))[0]
                case FreeSequence():
                    # Frees come straight from the coordinator to every stage, whatever the plan.
                    self.scheduler.free(msg.seq_id, "freed")
                case CacheSequence():
                    await self._keep(msg)
                case PrefixProbe():
                    ids = msg.token_ids
                    ok = (self.route is not None and self.stage is not None and not self._refusal(msg.plan_version)
                          and msg.plan_version == self.route.plan_version and ids is not None and ids.ndim == 1
                          and not ids.is_floating_point())
                    return PrefixMatch(self.serving_version, self.scheduler.prefix.probe(ids.tolist()) if ok else 0)
                case ReusePrefix() if self.scheduler.is_freed(msg.seq_id):
                    self.stats.late_dropped += 1  # its request ended while this was queued
                case ReusePrefix():
                    self._check_plan(msg.plan_version)
                    self.scheduler.reuse(msg)
                    await self.outbox.pass_on(self.route, self.index, msg)
                case ForkSequence() if self.scheduler.is_freed(msg.seq_id):
                    # freed (its request ended) while the fork was queued: creating it now would leak it
                    self.stats.late_dropped += 1
                    log.debug("late_fork_dropped", seq=msg.seq_id, parent=msg.parent_id)
                case Truncate():
                    self._check_plan(msg.plan_version)
                    self.scheduler.truncate(msg.seq_id, msg.new_length)
                    await self.outbox.pass_on(self.route, self.index, msg)
                case ForkSequence():
                    self._check_plan(msg.plan_version)
                    self.scheduler.fork(msg.parent_id, msg.seq_id, msg.prefix_length)
                    await self.outbox.pass_on(self.route, self.index, msg)
                case _:
                    raise StageError("unknown_type", f"a stage does not handle {type(msg).__name__}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the one error path: report at once, free the sequence, keep serving
            return await self._fail(msg, exc)
        return Ack(self.serving_version)

    async def _keep(self, msg: CacheSequence) -> None:
        """Keep a finished request's KV as a cached prefix: the cache held within its share of the
        budget, then the entry's spare room given back (a copy, in the compute thread)."""
        await self.worker.wait_fill(msg.seq_id)  # its last token left early: its cache is whole once filled
        if self.route is None or msg.plan_version != self.route.plan_version or not self.scheduler.keep(msg.seq_id):
            self.scheduler.free(msg.seq_id, "freed")
            return
        self.scheduler.prefix.enforce_share()  # at once, counting the new entry at its untrimmed size
        if self.scheduler.prefix.is_entry(msg.seq_id):
            await self.worker.in_compute(self.kv.trim, msg.seq_id)

    async def _fail(self, msg: Any, exc: Exception) -> ErrorReply:
        """The one error path: the coordinator told at once, naming the node that failed; the sequence freed."""
        self.stats.errors += 1
        if isinstance(exc, GroupLost):
            self.worker.group_lost(exc)
        reply = self.outbox.error_reply(msg, exc)
        seq = getattr(msg, "seq_id", None)
        if isinstance(seq, str) and seq and not isinstance(msg, ForkSequence):
            # (a failed fork created nothing: the child's first chunk then fails as unknown, reported)
            self.scheduler.free(seq, "failed")
        reply_to = getattr(msg, "reply_to", "")
        if reply_to:
            await self.outbox.report(reply_to, reply)
        return reply

    def _refusal(self, version: int) -> str:
        """Why this stage will never serve plan ``version`` ("": it may): the plan names another model."""
        if self.model_mismatch and self.route is not None and version == self.route.plan_version:
            return self.model_mismatch
        return ""

    def _check_plan(self, version: int) -> None:
        """Work for ``version`` only, and only while this stage holds the model that plan names.

        A plan version is unique in a home and names its model (``Route.model``), so this
        check binds every message to the model it was computed for: a request of another
        model is refused here with what each side holds, never run on the wrong weights.
        """
        refused = self._refusal(version)
        if refused:
            raise StageError("model_mismatch", refused)
        if self.route is None or self.stage is None:
            raise StageError("no_stage", "this device serves no stage in the current plan")
        if version != self.route.plan_version:
            raise StageError("stale_plan",
                             f"message for plan {version}, this stage runs plan {self.route.plan_version}")

    # -- the step: schedule -> execute -> update ----------------------------------------------
    async def step(self, msgs: list) -> list:
        """Run what queued, in order; one reply per message (an ``Ack`` where nothing else is due).

        Schedule: the messages split into runs (:meth:`StageScheduler.runs`): forwards of
        different sequences that share one pass, or one control message between passes, where
        it arrived. For a pass: each message admitted to its slot (:meth:`_admit`; one that
        fails its checks fails alone), then *execute* — one forward in the compute thread,
        the last stage sampling in the same hop — and *update*: slots released, results on
        to the next stage or back to the coordinator, failures reported (:meth:`_update`).
        """
        replies: list = [None] * len(msgs)
        runs = self.scheduler.runs(msgs)
        try:
            for k, run in enumerate(runs):
                self.progress.holding = [msgs[i] for later in runs[k:] for i in later]  # what still waits on us
                await self._run(msgs, run, replies)
        finally:
            self.progress.holding = []
        return [Ack(self.serving_version) if r is None else r for r in replies]

    async def _run(self, msgs: list, run: list[int], replies: list) -> None:
        """One run of the step: a control message, or a pass (admit, execute, update)."""
        if not isinstance(msgs[run[0]], StageForward):
            replies[run[0]] = await self.handle(msgs[run[0]])
            return
        works = await self._admit([msgs[i] for i in run], run, replies)
        if not works:
            return
        stage, kv = self.stage, self.kv
        slots = [w.slot for w in works]
        self.scheduler.begin_pass(slots)
        t = time.perf_counter()
        fill = None
        try:
            outcomes, fill = await self.worker.run(stage, kv, works, self.sampler.answer)
        finally:  # a sequence whose token left early stays busy until its skipped layers are filled
            held = {id(w.slot) for w in fill.works} if fill is not None else set()
            self.scheduler.end_pass([sl for sl in slots if id(sl) not in held])
        self.scheduler.count_pass(len(works), time.perf_counter() - t)
        await self._update(works, outcomes, fill, stage, replies)

    async def _admit(self, msgs: list[StageForward], where: list[int], replies: list) -> list[Work]:
        """Each message's share of the pass, its slot admitted (event loop); a late chunk is dropped, and a
        message that fails its checks fails alone (its coordinator told, its sequence freed)."""
        works: list[Work] = []
        for i, msg in zip(where, msgs):
            try:
                if self.scheduler.is_freed(msg.seq_id):  # freed (hang-up, failure) while queued upstream
                    self.stats.late_dropped += 1
                    log.debug("late_chunk_dropped", seq=msg.seq_id, offset=msg.position_offset)
                    continue
                self._check_plan(msg.plan_version)
                x, tree = self.worker.input_of(msg)  # before the slot changes: a hostile tree is bad input
                slot = self.scheduler.admit(msg, int(x.shape[0]))
                w = self.worker.work_for(msg, slot, x, tree)
            except Exception as exc:  # noqa: BLE001 - the one error path, per message
                replies[i] = await self._fail(msg, exc)
                continue
            w.index = i
            works.append(w)
        return works

    async def _update(self, works: list[Work], outcomes, fill, stage: StageModel, replies: list) -> None:
        """After the pass: each result on (or its failure reported), then the exited rows' fill awaited."""
        try:
            for w, (out, exc) in zip(works, outcomes):
                msg = w.msg
                if exc is not None:
                    replies[w.index] = await self._fail(msg, exc)
                    continue
                if w.item.may_exit and stage.exits is not None and isinstance(out, TokenResult):
                    self.stats.count_exit(out.exit_layer)
                self.stats.tokens += w.rows
                if msg.is_last_chunk and not msg.verify:
                    self.scheduler.prefix.share_prompt(w.slot)
                if self.scheduler.is_freed(msg.seq_id):  # freed while computing: do not pass stale work on
                    continue
                try:
                    await self.outbox.forward(self.route, self.index, msg, stage, out, w.want_logits)
                except Exception as exc:  # noqa: BLE001
                    replies[w.index] = await self._fail(msg, exc)
        finally:
            if fill is not None:
                await self._filled(fill, replies)

    async def _filled(self, fill, replies: list) -> None:
        """The exited sequences' caches are whole again (or a fill failed: that request replays)."""
        try:
            broken, seconds = await self.worker.filled(fill)
        finally:
            self.scheduler.end_pass([w.slot for w in fill.works])
        self.stats.busy_s += seconds
        for w in broken:
            replies[w.index] = await self._fail(w.msg, RuntimeError(
                "the layers an early exit skipped could not be computed; the request replays"))
