"""Serve this device's pipeline stage over the transport.

One service per daemon. It owns the stage's weights (only its layer range),
its KV cache (one sequence per in-flight request, keyed by the home-wide
sequence key) and one compute thread. Messages are handled strictly in
arrival order: chunk j+1 of a prompt needs chunk j's keys/values in the cache,
and a rollback must land before the next forward. While the compute thread
works on one chunk, the next chunks queue in ZeroMQ, and the previous result
is already travelling to the next stage — that overlap is the intra-sequence
pipeline.

Three rules keep the cache honest under hang-ups, failures and restarts:

- **Frees leave tombstones.** A coordinator frees a sequence on every stage
  directly (the chain may be broken), so a free can overtake prompt chunks
  still queued upstream. The stage remembers freed keys; a late chunk for a
  tombstoned key is dropped instead of re-creating the sequence.
- **One error path.** Whatever a message raises — a stale plan, a full cache,
  a malformed tensor, a bug — the coordinator named in it gets an
  ``ErrorReply`` at once and the sequence is freed (and tombstoned) here: a
  request that failed on one stage is dead everywhere.
- **Nothing lives forever.** A sequence untouched for ``idle_seq_timeout_s``
  is reaped (its coordinator vanished without freeing it).

On a GPU (``device``) the stage's weights and KV cache live there; messages
arrive and leave as host tensors. The forward moves a message's input to the
device and ``_compute_group`` moves its results back — both in the compute
thread, once per message — so the event loop never waits on the device, and
sampling, verification and the transport see only host tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from decoding.device import CPU, DeviceError, default_dtype, dtype_name, resolve_weights, to_host
from decoding.memory import release_free_memory
from decoding.errors import CacheFull, DecodingError
from decoding.penalties import Penalties
from decoding.sampling import SamplingParams, filtered_probs
from decoding.selector import TokenSelector
from decoding.speculative.generate import verify
from decoding.speculative.params import MAX_CANDIDATES
from decoding.speculative.tree import DraftTree
from decoding.batch import BatchItem
from decoding.models import StageModel
from meshd.errors import USER_ERRORS, MeshdError
from meshd.log import get_logger
from meshd.pipeline.links import Directory, Links
from meshd.pipeline.route import Route, model_mismatch
from meshd.pipeline.seqkey import coordinator_of
from transport.errors import TransportError
from transport.link import Request, StageServer
from transport.messages import (Ack, ErrorReply, ForkSequence, FreeSequence, Hello, HelloReply, StageForward,
                                TokenResult, Truncate)
from transport.node import TransportNode

log = get_logger("meshd.stage")

TOMBSTONES = 1 << 16  # freed keys remembered (keys are never reused; old ones age out)
MAX_BATCH_TOKENS = 512  # tokens in one batched pass (a lone larger message still runs)
MAX_LINGER_S = 0.005  # the longest a pass waits for a decoding sequence's next step to join it
BATCH_HIST_MAX = 16  # batch sizes counted exactly up to this; larger ones in its bucket


def _rows(msg: StageForward) -> int:
    t = msg.hidden if msg.hidden is not None else msg.token_ids
    return int(t.shape[0]) if t is not None and t.ndim >= 1 else 1


@dataclass
class _Work:
    msg: StageForward
    item: BatchItem
    tree: DraftTree | None
    want_logits: bool
    normed: bool
    index: int = 0

    @property
    def rows(self) -> int:
        return self.item.tokens


class StageError(MeshdError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class StageStats:
    forwards: int = 0
    tokens: int = 0
    activation_bytes_out: int = 0
    activation_bytes_to: dict[str, int] = field(default_factory=dict)  # next stage's node id -> bytes
    busy_s: float = 0.0
    errors: int = 0
    late_dropped: int = 0
    reaped: int = 0
    batches: dict[int, int] = field(default_factory=dict)  # sequences in a pass -> passes
    started: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict:
        up = max(time.monotonic() - self.started, 1e-9)
        return {"forwards": self.forwards, "tokens": self.tokens, "busy_s": round(self.busy_s, 3),
                "activation_bytes_out": self.activation_bytes_out,
                "activation_bytes_to": dict(self.activation_bytes_to),
                "utilisation": round(self.busy_s / up, 3), "errors": self.errors,
                "late_dropped": self.late_dropped, "reaped": self.reaped,
                "batch_sizes": {str(k): v for k, v in sorted(self.batches.items())}}


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, CacheFull):
        return "cache_full"
    if isinstance(exc, StageError):
        return exc.code
    if isinstance(exc, TransportError):
        return "link"
    if isinstance(exc, USER_ERRORS):  # also decoding's (a bad cache op, a context overflow)
        return "stage"
    return "internal"


class StageService:
    def __init__(self, node: TransportNode, node_id: str, model_source, directory: Directory,
                 dtype: torch.dtype | None = None, max_kv_tokens: int = 1 << 16,
                 activation_dtype: str | None = None, send_timeout_s: float = 5.0,
                 idle_seq_timeout_s: float = 300.0, medusa=None, max_batch_tokens: int = MAX_BATCH_TOKENS,
                 device: torch.device | None = None, packed: str = ""):
        """``device``: where the stage computes (default the CPU); ``dtype`` None: that device's default;
        ``packed``: the packing of this device's own numeric mode ("" dense). A plan that names a mode
        (:attr:`Route.weights`) overrides both, so every member computes alike."""
        self.node = node
        self.node_id = node_id
        self.source = model_source
        self.directory = directory
        self.device = CPU if device is None else torch.device(device)
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        self.packed = packed
        self.own_mode = packed or dtype_name(self.dtype)
        self.max_kv_tokens = max_kv_tokens
        self.activation_dtype = activation_dtype
        self.send_timeout_s = send_timeout_s
        self.idle_seq_timeout_s = idle_seq_timeout_s
        # 0 or 1: no batching (one message per pass, the way every stage used to run).
        self.max_batch_tokens = int(max_batch_tokens)
        # Lingering for stragglers (see _linger): when each sequence was last seen stepping here,
        # the last pass's duration, and how often lingering caught someone lately.
        self._stepping: dict[str, float] = {}
        self._last_pass_s = 0.0
        self._waiting_for: set[str] | None = None
        self._linger_pays = 1.0
        self._passes = 0
        self.route: Route | None = None
        self.index: int | None = None
        self.stage: StageModel | None = None
        self.kv = None
        self.samplers: dict[str, TokenSelector] = {}  # last stage: per sequence, logits -> tokens
        self.stats = StageStats()
        self.server: StageServer | None = None
        self.links = Links(node, directory)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self._deploy_lock = asyncio.Lock()
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._touched: dict[str, float] = {}
        self._busy: set[str] = set()  # sequences the compute thread is working on now
        self._free_after_compute: set[str] = set()
        self._reaper: asyncio.Task | None = None
        self.vocab_size = int(getattr(getattr(model_source, "config", None), "vocab_size", 0) or 0)
        self.model_mismatch = ""  # the current plan names another model than this stage's file holds
        # Medusa heads for the last stage: ``medusa(stage)`` -> MedusaSource (or raises DrafterError);
        # loaded on first use, the outcome (or the reason there are none) kept until the next deploy.
        self._medusa_factory = medusa
        self._medusa = None
        self._medusa_error = ""

    # -- lifecycle --------------------------------------------------------------
    async def start(self, address: str = "tcp://127.0.0.1:0") -> str:
        # Frees and readiness probes overtake queued chunks: a hung-up request stops
        # costing compute at once, and a probe is not stuck behind a long prefill.
        batching = self.max_batch_tokens > 1
        self.server = await self.node.serve(self.handle, address, ordered=True,
                                            urgent=lambda m: isinstance(m, (FreeSequence, Hello)),
                                            batch_handler=self.handle_batch if batching else None,
                                            batch_linger=self._linger if batching else None)
        self._reaper = asyncio.create_task(self._reap_loop(), name="stage-reaper")
        return self.server.address

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await self.links.close()
        if self.server is not None:
            await self.server.close()
        self._compute.shutdown(wait=False, cancel_futures=True)

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
            self.model_mismatch = model_mismatch(route.model, str(getattr(self.source, "identity", "") or "")) \
                if route.model else ""
            if self.model_mismatch and rng is not None:
                log.warning("stage_model_mismatch", plan_version=route.plan_version, error=self.model_mismatch)
                rng = None  # never load another model's layer range from this file
            if rng is None:
                self.stage, self.kv = None, None
            elif (self.stage is None or (self.stage.first, self.stage.end) != rng
                  or self._mode_for(route) != self.mode):
                self._adopt_mode(route)
                self.stage = None  # not serving while the new range loads
                log.info("stage_loading", plan_version=route.plan_version, first=rng[0], end=rng[1],
                         weights=self.mode)
                t = time.perf_counter()
                loop = asyncio.get_running_loop()
                dtype, packed = self.dtype, self.packed
                stage = await loop.run_in_executor(
                    self._compute, lambda: self.source.load_stage(rng[0], rng[1], dtype, self.device, packed))
                release_free_memory()  # what reading and repacking the tensors left behind
                log.info("stage_loaded", first=rng[0], end=rng[1], seconds=round(time.perf_counter() - t, 2),
                         weight_mb=round(stage.weight_bytes() / 1e6, 1), weights=self.mode)
                self.stage = stage
                if stage.lm_head is not None:
                    self._warm_grammar()
            if self.stage is not None:
                self.kv = self.stage.new_cache(self.max_kv_tokens)
            self._medusa, self._medusa_error = None, ""
            self.samplers.clear()
            self._touched.clear()
            self._stepping.clear()
            self.route, self.index = route, idx

    @property
    def mode(self) -> str:
        """The numeric mode this stage computes in now."""
        return self.packed or dtype_name(self.dtype)

    def _mode_for(self, route: Route) -> str:
        """The mode a plan asks for, if this device can compute in it; else this device's own (logged)."""
        wanted = route.weights or self.own_mode
        try:
            resolve_weights(wanted, self.device)
        except DeviceError as exc:
            log.warning("stage_mode_unavailable", wanted=wanted, using=self.own_mode, error=str(exc))
            return self.own_mode
        return wanted

    def _adopt_mode(self, route: Route) -> None:
        mode = self._mode_for(route)
        if mode != self.mode:
            self.dtype, self.packed = resolve_weights(mode, self.device)

    def _warm_grammar(self) -> None:
        """This stage samples: set the grammar engine up for the vocabulary in the background, so the
        first tool-calling or structured request does not wait for it."""
        try:
            tok = self.source.tokenizer
        except Exception:  # noqa: BLE001 - a model without a tokenizer (token ids only) has no grammar
            return
        if getattr(tok, "path", None) is None:
            return
        from decoding.constrained import warm

        vocab = self.stage.config.vocab_size

        def run() -> None:
            try:
                warm(tok.path, vocab, tuple(tok.eos_ids))
            except Exception as exc:  # noqa: BLE001 - only a head start; a real request reports errors
                log.warning("grammar_warm_failed", error=f"{type(exc).__name__}: {exc}")

        asyncio.get_running_loop().run_in_executor(None, run)

    # -- what the daemon and status need ---------------------------------------------
    def kv_tokens_in_use(self) -> int:
        return int(self.kv.reserved_tokens) if self.kv is not None else 0

    def sequences(self) -> list[str]:
        return list(self.kv.sequences()) if self.kv is not None else []

    def foreign_sequences(self) -> int:
        """Sequences other daemons coordinate through this stage (SIGTERM drains them)."""
        return sum(1 for s in self.sequences() if coordinator_of(s) != self.node_id)

    def status(self) -> dict[str, Any]:
        return {"plan_version": self.serving_version,
                "layers": [self.stage.first, self.stage.end] if self.stage is not None else None,
                "sequences": len(self.sequences()), "kv_tokens_in_use": self.kv_tokens_in_use(),
                "kv_tokens_max": self.max_kv_tokens, "device": str(self.device), "dtype": dtype_name(self.dtype),
                "weights": self.mode,
                **self.stats.to_dict()}

    # -- message handling ------------------------------------------------------------
    async def handle(self, msg: Any, req: Request) -> Any:
        try:
            match msg:
                case Hello():  # readiness probe: which plan is loaded and serving here
                    refused = self._refusal(msg.plan_version)
                    return HelloReply(self.node_id, self.serving_version, "", accepted=not refused, reason=refused)
                case StageForward():
                    reply = await self._forward(msg)  # errors are already reported (per message)
                    if reply is not None:
                        return reply
                case FreeSequence():
                    # Frees come straight from the coordinator to every stage, whatever the plan.
                    self._free(msg.seq_id, "freed")
                case ForkSequence() if msg.seq_id in self._tombstones:
                    # freed (its request ended) while the fork was queued: creating it now would leak it
                    self.stats.late_dropped += 1
                    log.debug("late_fork_dropped", seq=msg.seq_id, parent=msg.parent_id)
                case Truncate() | ForkSequence():
                    self._check_plan(msg.plan_version)
                    self._control(msg)
                    await self._pass_on(msg)
                case _:
                    raise StageError("unknown_type", f"a stage does not handle {type(msg).__name__}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the one error path: report at once, free the sequence, keep serving
            return await self._fail(msg, exc)
        return Ack(self.serving_version)

    async def _fail(self, msg: Any, exc: Exception) -> ErrorReply:
        self.stats.errors += 1
        code = _error_code(exc)
        rid = getattr(msg, "request_id", "")
        seq = getattr(msg, "seq_id", None)
        text = str(exc) if code != "internal" else f"{type(exc).__name__}: {exc}"
        log.warning("stage_error", code=code, error=text, request_id=rid, seq=seq,
                    message_type=type(msg).__name__, exc_info=code == "internal")
        reply = ErrorReply(code, f"{self.node_id}: {text}", rid if isinstance(rid, str) else "")
        if isinstance(seq, str) and seq and not isinstance(msg, ForkSequence):
            # (a failed fork created nothing: the child's first chunk then fails as unknown, reported)
            self._free(seq, "failed")
        reply_to = getattr(msg, "reply_to", "")
        if reply_to:
            await self._report(reply_to, reply)
        return reply

    def _free(self, seq: str, why: str) -> None:
        self._tombstones[seq] = None
        self._tombstones.move_to_end(seq)
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        self.samplers.pop(seq, None)
        self._touched.pop(seq, None)
        self._stepping.pop(seq, None)
        if seq in self._busy:  # the compute thread is using its cache: free it when the pass ends
            self._free_after_compute.add(seq)
            return
        if self.kv is not None and seq in self.kv:
            self.kv.free(seq)
            log.debug("sequence_freed", seq=seq, why=why)

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

    def _input_of(self, msg: StageForward, stage: StageModel) -> torch.Tensor:
        if stage.is_first:
            ids = msg.token_ids
            if ids is None or ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point():
                raise StageError("bad_input", "the first stage needs a non-empty 1-d tensor of token ids")
            ids = ids.to(torch.long)
            vocab = stage.config.vocab_size
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise StageError("bad_input", f"token ids must be in [0, {vocab})")
            return ids
        h = msg.hidden
        if h is None or h.ndim != 2 or h.shape[1] != stage.config.hidden_size or h.shape[0] == 0:
            raise StageError("bad_input", f"expected hidden states [n, {stage.config.hidden_size}]")
        return h

    # -- forwards, batched ----------------------------------------------------------------
    async def handle_batch(self, msgs: list, reqs: list) -> list:
        """Everything queued at once: forwards of different sequences share one pass.

        Order is kept where it matters. A sequence's second message waits for
        the next pass (its rows need the first one's keys), and any control
        message runs between passes exactly where it arrived. A pass holds at
        most ``max_batch_tokens`` tokens (a lone message may exceed it), so a
        long prompt chunk does not ride with a crowd of decode steps that would
        each wait for all of it.
        """
        replies: list = [None] * len(msgs)
        group: list[int] = []
        seqs: set = set()
        tokens = 0
        if self._waiting_for is not None:  # did lingering catch anyone we waited for?
            caught = bool(self._waiting_for & {getattr(m, "seq_id", None) for m in msgs})
            self._linger_pays = 0.8 * self._linger_pays + 0.2 * caught
            self._waiting_for = None
        stepping = self._recently_stepping()
        cap = self._steps_per_pass(stepping)
        steps = 0  # decode steps / verify rounds in the group

        async def flush():
            nonlocal tokens, steps
            if group:
                for i, r in zip(group, await self._forward_group([msgs[i] for i in group])):
                    replies[i] = r
            group.clear()
            seqs.clear()
            tokens = steps = 0

        for i, m in enumerate(msgs):
            if isinstance(m, StageForward):
                n = _rows(m)
                is_step = m.seq_id in stepping
                if m.seq_id in seqs or (group and tokens + n > self.max_batch_tokens) or (is_step and steps >= cap):
                    await flush()
                group.append(i)
                seqs.add(m.seq_id)
                tokens += n
                steps += is_step
            else:
                await flush()
                replies[i] = await self.handle(m, reqs[i])
        await flush()
        return [Ack(self.serving_version) if r is None else r for r in replies]

    def _linger(self, reqs: list) -> float:
        """Seconds the batch lane should wait for more before this pass (0: start now).

        Decoding sequences fall into step: while the stage computes one, the
        other's next token is still on its way back from the coordinator, so
        it arrives just after the pass started and each runs alone. Waiting a
        moment — at most a tenth of a pass, never over MAX_LINGER_S — for the
        sequences that were stepping here lately lets them share the pass.
        When lingering stops catching anyone (their steps are a whole pass
        away), it stops, trying again every 32 passes.
        """
        if self._last_pass_s <= 0:
            return 0.0
        here = {r.message.seq_id for r in reqs if isinstance(r.message, StageForward)}
        if not here:
            return 0.0
        stepping = self._recently_stepping()
        missing = stepping - here
        if not missing or len(here & stepping) >= self._steps_per_pass(stepping):
            return 0.0
        if self._linger_pays < 0.3 and self._passes % 32:
            return 0.0
        if self._waiting_for is None:
            self._waiting_for = missing
        return min(MAX_LINGER_S, 0.1 * self._last_pass_s)

    def _recently_stepping(self) -> set[str]:
        """Sequences decoding through this stage now (a step or verify round within the last few passes)."""
        now = time.monotonic()
        recent = max(0.05, 3 * self._last_pass_s)
        return {q for q, t in self._stepping.items() if now - t < recent}

    def _steps_per_pass(self, stepping: set[str]) -> int:
        """How many decoding sequences one pass should take: enough to share the weights' reads, few
        enough that the pipeline keeps as many groups in flight as it has stages — merging two
        sequences that alternate between two stages would leave each stage idle half the time."""
        depth = len(self.route.stages) if self.route is not None else 1
        return max(1, -(-len(stepping) // max(1, depth)))

    async def _forward(self, msg: StageForward):
        return (await self._forward_group([msg]))[0]

    async def _forward_group(self, msgs: list[StageForward]) -> list:
        """One forward pass for these messages (distinct sequences); one reply per message.

        A message that fails its checks fails alone (its coordinator is told,
        its sequence freed); the others still run.
        """
        replies: list = [None] * len(msgs)
        works: list[_Work] = []
        for i, msg in enumerate(msgs):
            try:
                w = self._prepare(msg)
            except Exception as exc:  # noqa: BLE001 - the one error path, per message
                replies[i] = await self._fail(msg, exc)
                continue
            if w is not None:
                w.index = i
                works.append(w)
        if not works:
            return replies
        stage, kv = self.stage, self.kv
        self._busy.update(w.msg.seq_id for w in works)
        t = time.perf_counter()
        try:
            outcomes = await asyncio.get_running_loop().run_in_executor(
                self._compute, self._compute_group, stage, kv, works)
        finally:
            self._busy.difference_update(w.msg.seq_id for w in works)
            for seq in [w.msg.seq_id for w in works if w.msg.seq_id in self._free_after_compute]:
                self._free_after_compute.discard(seq)
                self._free(seq, "freed")
        self._last_pass_s = time.perf_counter() - t
        self._passes += 1
        self.stats.busy_s += self._last_pass_s
        self.stats.forwards += 1
        size = min(len(works), BATCH_HIST_MAX)
        self.stats.batches[size] = self.stats.batches.get(size, 0) + 1
        for w, (out, exc) in zip(works, outcomes):
            msg = w.msg
            if exc is not None:
                replies[w.index] = await self._fail(msg, exc)
                continue
            self.stats.tokens += w.rows
            if msg.seq_id in self._tombstones:  # freed while computing: do not pass stale work on
                continue
            try:
                await self._finish(msg, stage, out, w.want_logits)
            except Exception as exc:  # noqa: BLE001
                replies[w.index] = await self._fail(msg, exc)
        return replies

    def _prepare(self, msg: StageForward) -> "_Work | None":
        """Checks and cache bookkeeping before a forward (event loop; None: a late chunk, dropped)."""
        seq = msg.seq_id
        if seq in self._tombstones:  # freed (hang-up, failure) while this chunk was queued upstream
            self.stats.late_dropped += 1
            log.debug("late_chunk_dropped", seq=seq, offset=msg.position_offset)
            return None
        self._check_plan(msg.plan_version)
        stage, kv = self.stage, self.kv
        x = self._input_of(msg, stage)
        if seq not in kv:
            if msg.position_offset != 0:
                raise StageError("unknown_sequence", f"sequence {seq} is not in this stage's cache "
                                                     f"(offset {msg.position_offset})")
            kv.create(seq, max(int(msg.capacity), x.shape[0], 16))
        if msg.commit_start >= 0:  # the previous verify round's outcome: keep its accepted nodes
            self._apply_commit(seq, msg.commit_start, msg.commit_keep or [])
        tree = self._tree_of(msg, x) if msg.verify else None
        if kv.length(seq) != msg.position_offset:
            raise StageError("position_mismatch", f"sequence {seq} holds {kv.length(seq)} positions, "
                                                  f"message starts at {msg.position_offset}")
        self._touched[seq] = time.monotonic()
        if msg.is_last_chunk and x.shape[0] <= MAX_CANDIDATES + 1:  # a decode step or a verify round
            self._stepping[seq] = self._touched[seq]
        want_logits = stage.is_last and msg.is_last_chunk
        mask = tree.mask() if tree is not None else msg.tree_mask
        normed = want_logits and (msg.verify or msg.medusa_paths > 0)
        item = BatchItem(seq, x, mask, all_logits=msg.verify, head=want_logits, return_normed=normed,
                         attention_tail=max(0, min(int(msg.attention_tail), 64)) if want_logits else 0)
        return _Work(msg, item, tree, want_logits, normed)

    def _compute_group(self, stage: StageModel, kv, works: list["_Work"]) -> list[tuple[Any, Exception | None]]:
        """The forward, and on the last stage sampling / acceptance / drafting, in one hop (compute thread).

        Should the pass itself fail, each message is retried alone, so one
        sequence's problem stays that sequence's.
        """
        probes: dict[int, torch.Tensor] = {}
        try:
            outs = stage.forward_batch(kv, [w.item for w in works], probes)
            if stage.device.type != "cpu":  # results to the host here, once per message, off the event loop
                outs = [to_host(o) for o in outs]
        except Exception as exc:  # noqa: BLE001
            if len(works) == 1:
                return [(None, exc)]
            log.warning("batch_failed_retrying_alone", sequences=len(works), error=f"{type(exc).__name__}: {exc}")
            return [self._compute_group(stage, kv, [w])[0] for w in works]
        results = []
        for i, (w, out) in enumerate(zip(works, outs)):
            try:
                if not w.want_logits:
                    results.append((out, None))
                    continue
                result = self._result(w.msg, w.tree, out, w.normed)
                if i in probes:  # the drafter of a cloud-verified answer judges importance from it
                    result.attention = [float(a) for a in probes[i][-1].tolist()]
                results.append((result, None))
            except Exception as exc:  # noqa: BLE001 - reported per message by the caller
                results.append((None, exc))
        return results

    async def _finish(self, msg: StageForward, stage: StageModel, out, want_logits: bool) -> None:
        if not stage.is_last:
            # Everything travels on (sampling, verify tree, commit, shaping); only the payload changes:
            # our activations, and token ids only where the last stage needs them (a verify round).
            nxt = dataclasses.replace(msg, hidden=out, token_ids=msg.token_ids if msg.verify else None)
            to = await self._send_next(nxt)
            elem = 2 if self.activation_dtype in ("float16", "bfloat16") else out.element_size()
            sent = out.numel() * elem
            self.stats.activation_bytes_out += sent
            self.stats.activation_bytes_to[to] = self.stats.activation_bytes_to.get(to, 0) + sent
        elif want_logits and out is not None:
            await self._report(msg.reply_to, out)

    def _result(self, msg: StageForward, tree: DraftTree | None, out, normed: bool) -> TokenResult:
        """The last stage's answer (compute thread): a sampled token, or a verified round."""
        logits, hidden = out if normed else (out, None)
        if tree is not None:
            return self._verify(msg, tree, logits, hidden)
        result = self._sample(msg, logits[-1])
        if msg.medusa_paths > 0:
            self._attach_proposals(result, hidden[-1], msg.medusa_paths)
        return result

    def _tree_of(self, msg: StageForward, x: torch.Tensor) -> DraftTree:
        """The verify round's token tree, checked: hostile parents must fail here, not in attention."""
        ids = msg.token_ids
        if ids is None or ids.ndim != 1 or not 1 <= ids.numel() <= MAX_CANDIDATES + 1:
            raise StageError("bad_input", f"a verify round needs 1..{MAX_CANDIDATES + 1} token ids")
        if ids.numel() != x.shape[0]:
            raise StageError("bad_input", "a verify round's token ids and hidden states differ in length")
        parents = msg.tree_parents if msg.tree_parents is not None else list(range(-1, ids.numel() - 1))
        try:
            return DraftTree(tuple(int(t) for t in ids.tolist()), tuple(int(p) for p in parents))
        except ValueError as exc:
            raise StageError("bad_input", f"bad token tree: {exc}") from None

    def _apply_commit(self, seq: str, start: int, keep: list[int]) -> None:
        kv = self.kv
        if start + len(keep) > kv.length(seq) or start < 0 or any(not 0 <= k < kv.length(seq) - start for k in keep):
            raise StageError("position_mismatch", f"cannot keep {keep} at {start}: sequence {seq} holds "
                                                  f"{kv.length(seq)} positions")
        if keep == list(range(len(keep))):
            kv.truncate(seq, start + len(keep))  # a chain's accepted prefix: nothing moves
        else:
            kv.keep(seq, start, keep)

    def _selector_for(self, msg: StageForward) -> TokenSelector:
        sel = self.samplers.get(msg.seq_id)
        if sel is None:
            params = SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, seed=msg.seed)
            constraint = None
            tok = None
            if msg.constraint is not None:
                from decoding.constrained import make_constraint

                tok = self.source.tokenizer
                constraint = make_constraint(msg.constraint, tok.path, self.stage.config.vocab_size,
                                             tuple(tok.eos_ids))
            penalties = None
            if msg.penalties:
                try:
                    penalties = Penalties(**msg.penalties)
                except TypeError as exc:
                    raise StageError("bad_input", f"bad penalties: {exc}") from None
            eos = tuple(tok.eos_ids) if tok is not None else ()
            sel = self.samplers[msg.seq_id] = TokenSelector(
                params, penalties=penalties, constraint=constraint, prompt_tail=msg.prompt_tail or (),
                eos_ids=eos, history=msg.history or (), skip=msg.sample_step)
        return sel

    def _verify(self, msg: StageForward, tree: DraftTree, logits: torch.Tensor, hidden: torch.Tensor
                ) -> TokenResult:
        """Acceptance at the last stage (compute thread). This stage's own KV rollback waits, like
        every other stage's, for the next round's header."""
        sel = self._selector_for(msg)
        if not sel.plain:
            raise StageError("bad_input", "speculative rounds cannot verify a grammar- or penalty-shaped sequence")
        verdict = verify(tree, logits, sel.sampler, msg.typical)
        result = TokenResult(request_id=msg.request_id, plan_version=msg.plan_version, seq_id=msg.seq_id,
                             token_ids=torch.tensor(verdict.committed(tree), dtype=torch.long),
                             chunk_index=msg.chunk_index, path=list(verdict.path))
        if msg.medusa_paths > 0:
            self._attach_proposals(result, hidden[verdict.path[-1]], msg.medusa_paths)
        return result

    def _attach_proposals(self, result: TokenResult, hidden: torch.Tensor, paths: int) -> None:
        prop, note = self._propose(hidden, paths)
        if prop is None:
            result.note = note
        else:
            result.proposals, result.proposal_values = prop.sequences, list(prop.values)

    def _propose(self, hidden: torch.Tensor, paths: int):
        if self._medusa is None and not self._medusa_error:
            try:
                if self._medusa_factory is None:
                    raise DecodingError("no Medusa heads are configured for this model")
                self._medusa = self._medusa_factory(self.stage)
            except Exception as exc:  # noqa: BLE001 - drafting is optional: never fail a request over it
                self._medusa_error = str(exc) if isinstance(exc, (DecodingError, OSError)) else repr(exc)
                log.warning("medusa_unavailable", error=self._medusa_error)
        if self._medusa is None:
            return None, f"medusa heads unavailable: {self._medusa_error}"
        return self._medusa.propose(hidden, min(int(paths), MAX_CANDIDATES)), ""

    def _sample(self, msg: StageForward, logits: torch.Tensor) -> TokenResult:
        seq = msg.seq_id
        sampler = self._selector_for(msg)
        token = sampler(logits)
        topk_ids = topk_probs = None
        if msg.return_topk > 0:  # the compressed distribution a verifier needs, instead of 49k logits
            params = sampler.sampler.params
            probs = torch.softmax(logits.float(), -1) if params.greedy else filtered_probs(logits, params)
            top = torch.topk(probs, min(msg.return_topk, probs.shape[-1]))
            topk_ids, topk_probs = top.indices.to(torch.int64), top.values.to(torch.float32)
        return TokenResult(request_id=msg.request_id, plan_version=msg.plan_version, seq_id=seq,
                           token_ids=torch.tensor([token], dtype=torch.long), chunk_index=msg.chunk_index,
                           topk_ids=topk_ids, topk_probs=topk_probs, finished=sampler.finished)

    def _control(self, msg) -> None:
        kv = self.kv
        if isinstance(msg, Truncate):
            kv.truncate(msg.seq_id, msg.new_length)
        elif isinstance(msg, ForkSequence):
            kv.fork(msg.parent_id, msg.seq_id, msg.prefix_length)

    async def _pass_on(self, msg) -> None:
        if self.route.next_after(self.index) is not None:
            await self._send_next(msg)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.idle_seq_timeout_s / 10))
            cutoff = time.monotonic() - self.idle_seq_timeout_s
            for seq, t in list(self._touched.items()):
                if t < cutoff:
                    self.stats.reaped += 1
                    log.warning("sequence_reaped", seq=seq, idle_s=round(time.monotonic() - t, 1))
                    self._free(seq, "reaped")

    # -- links ----------------------------------------------------------------------------
    async def _send_next(self, msg) -> str:
        """Send ``msg`` to the next stage; returns its node id."""
        nxt = self.route.next_after(self.index)
        peer = await self.links.to(nxt.node_id)
        await peer.send(msg, timeout=self.send_timeout_s, activation_dtype=self.activation_dtype)
        return nxt.node_id

    async def _report(self, reply_to: str, msg) -> None:
        """Send to a coordinator; ``reply_to`` is "node_id|address" (its key comes from the directory)."""
        node_id, _, address = reply_to.partition("|")
        try:
            peer = await self.links.to(node_id, address)
            await peer.send(msg, timeout=self.send_timeout_s)
        except (TransportError, KeyError) as exc:
            log.warning("report_failed", to=reply_to, error=str(exc), message_type=type(msg).__name__)
