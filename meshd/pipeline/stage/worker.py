"""The stage's worker: its layers, and the one compute thread that runs them.

The forward of a group of sequences is one batched pass in the compute thread;
on the last stage the sampler turns its logits into tokens in the same hop, so
the event loop never waits on the model. On a GPU (``device``) the weights and
the KV cache live there; messages arrive and leave as host tensors: a
message's input moves to the device inside the forward, and :meth:`StageWorker.run`
moves its results back, once per message, so the event loop, the sampler and
the transport see only host tensors.

An early exit (``decoding.exits``) answers a decode row before the stage's last
layers; the worker then runs the layers that row skipped in the same thread
(:class:`ExitFill`), right behind the pass, and keeps the sequence's cache off
limits (:meth:`StageWorker.wait_fill`) until they have written its keys and values.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from decoding.device import CPU, DeviceError, default_dtype, dtype_name, resolve_weights, to_host
from decoding.errors import DecodingError
from decoding.exits.bound import BoundExits
from decoding.memory import freeze_long_lived, release_free_memory
from decoding.speculative.params import MAX_CANDIDATES
from decoding.speculative.tree import DraftTree
from decoding.batch import BatchItem
from decoding.models import StageModel
from meshd.log import get_logger
from meshd.pipeline.route import Route
from meshd.pipeline.stage.errors import StageError
from meshd.pipeline.stage.slot import SeqSlot
from meshd.pipeline.tensor.grouped import GroupedStage
from partition.ids import SeqKey
from transport.stage_messages import StageForward

log = get_logger("meshd.stage")

__all__ = ["ExitFill", "Work", "StageWorker", "tree_of"]

Outcome = tuple[Any, Exception | None]  # (activations or a TokenResult, None) or (None, what failed)


@dataclass
class Work:
    """One message's share of a pass."""

    msg: StageForward
    slot: SeqSlot
    item: BatchItem
    tree: DraftTree | None  # a verify round's token tree
    want_logits: bool  # the last stage answers this one
    normed: bool  # ...and needs the final hidden states too (verification, Medusa heads)
    index: int = 0  # the message's place in its group

    @property
    def rows(self) -> int:
        return self.item.tokens


@dataclass(frozen=True)
class ExitFill:
    """The layers a pass's exited rows skipped, computing in the compute thread."""

    future: asyncio.Future  # -> (the sequences whose fill failed, seconds computing)
    works: list[Work]  # the messages whose token left early: their slots stay busy until the fill is done


def tree_of(msg: StageForward, x: torch.Tensor) -> DraftTree:
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


class StageWorker:
    def __init__(self, source, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 packed: str = "", exits: Callable[[StageModel], Any] | None = None):
        """``device``: where the stage computes (default the CPU); ``dtype`` None: that device's default;
        ``packed``: the packing of this device's own numeric mode ("" dense). A plan that names a mode
        (:attr:`Route.weights`) overrides both, so every member computes alike. ``exits(stage)``: the early-exit
        heads for this model (``decoding.exits.heads.ExitHeads``; raises ``DecodingError`` when there are none),
        bound to a stage that holds the LM head and an exit layer."""
        self.source = source
        self._exits_factory = exits
        self.exits_note = "off: no exit heads configured" if exits is None else ""
        self.device = CPU if device is None else torch.device(device)
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        self.packed = packed
        self.own_mode = packed or dtype_name(self.dtype)
        self.stage: StageModel | None = None
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self._filling: dict[SeqKey, asyncio.Future] = {}  # exited sequences whose skipped layers are computing
        self._following: asyncio.Future | None = None  # this device follows a tensor group's first member
        self._stopping = threading.Event()
        self._leaving: set[asyncio.Task] = set()  # a lost tensor group being left

    def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)

    # -- the layers ----------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """The numeric mode this stage computes in now."""
        return self.packed or dtype_name(self.dtype)

    def mode_for(self, route: Route) -> str:
        """The mode a plan asks for, if this device can compute in it; else this device's own (logged)."""
        wanted = route.weights or self.own_mode
        try:
            resolve_weights(wanted, self.device)
        except DeviceError as exc:
            log.warning("stage_mode_unavailable", wanted=wanted, using=self.own_mode, error=str(exc))
            return self.own_mode
        return wanted

    def holds(self, layers: tuple[int, int], route: Route) -> bool:
        """Whether the loaded layers already are ``layers`` in the mode ``route`` asks for (a tensor group's
        share never is: its links are the plan's)."""
        return (self.stage is not None and (self.stage.first, self.stage.end) == tuple(layers)
                and self.mode_for(route) == self.mode and not self.in_group)

    async def load(self, layers: tuple[int, int], route: Route) -> StageModel:
        """Load ``layers`` in the plan's mode, in the compute thread; nothing is served meanwhile."""
        mode = self.mode_for(route)
        if mode != self.mode:
            self.dtype, self.packed = resolve_weights(mode, self.device)
        self.stage = None  # not serving while the new range loads
        first, end = layers
        log.info("stage_loading", plan_version=route.plan_version, first=first, end=end, weights=self.mode)
        t = time.perf_counter()
        dtype, packed, device = self.dtype, self.packed, self.device
        stage = await asyncio.get_running_loop().run_in_executor(
            self._compute, lambda: self._loaded(self.source.load_stage(first, end, dtype, device, packed)))
        release_free_memory()  # what reading and repacking the tensors left behind
        log.info("stage_loaded", first=first, end=end, seconds=round(time.perf_counter() - t, 2),
                 weight_mb=round(stage.weight_bytes() / 1e6, 1), weights=self.mode)
        self.stage = stage
        return stage

    def _loaded(self, stage: StageModel) -> StageModel:
        """A stage just loaded (compute thread): its exits bound, and the heap it lives in left out of
        later garbage collections (decoding.memory.freeze_long_lived)."""
        stage = self._bind_exits(stage)
        freeze_long_lived()
        return stage

    def _bind_exits(self, stage: StageModel) -> StageModel:
        """Early exits are checked where the LM head is; a stage without exit layers has none (compute
        thread, with the load: reading the heads and widening their head rows stays off the event loop)."""
        if self._exits_factory is None:
            return stage
        self.exits_note = ""
        if not stage.is_last:
            return stage
        try:
            bound = BoundExits(self._exits_factory(stage), stage)
        except (DecodingError, OSError, ValueError) as exc:
            self.exits_note = f"unavailable: {exc}"
            log.warning("exits_unavailable", error=str(exc))
            return stage
        if not bound.at:
            self.exits_note = f"none: this stage's layers [{stage.first}, {stage.end}) hold no exit layer"
            return stage
        stage.exits = bound
        log.info("exits_ready", layers=bound.layers, shortlist=bound.heads.size)
        return stage

    @property
    def exit_layers(self) -> list[int]:
        stage = self.stage
        return stage.exits.layers if stage is not None and stage.exits is not None else []

    def unload(self) -> None:
        self.stage = None

    # -- a seat in a tensor group (meshd.pipeline.tensor.seat) -----------------------------------
    async def lead_group(self, route: Route, index: int, keypair, bind: str) -> StageModel:
        """Rank 0 of stage ``index``'s tensor group: links, this member's share, and the stage to serve."""
        from meshd.pipeline.tensor.seat import lead

        await self.leave_group()
        self.dtype, self.packed = resolve_weights("gguf", self.device)  # a group adds float32 partial sums
        self.stage = None
        t = time.perf_counter()
        stage = await asyncio.get_running_loop().run_in_executor(
            self._compute, lead, self.source, route.stages[index], keypair, bind, int(route.plan_version))
        log.info("stage_loaded", first=stage.first, end=stage.end, seconds=round(time.perf_counter() - t, 2),
                 weights=self.mode, tensor_group=[s.node_id for s in route.stages[index].group])
        self.exits_note = "off: a tensor group's layers are split"
        self.stage = stage
        return stage

    async def follow_group(self, route: Route, index: int, rank: int, keypair, bind: str) -> None:
        """A later rank of stage ``index``'s group: the compute thread follows its first member from now
        until :meth:`leave_group` (this device serves no stage of its own meanwhile)."""
        from meshd.pipeline.tensor.seat import follow_seat

        await self.leave_group()
        self.dtype, self.packed = resolve_weights("gguf", self.device)
        self.stage = None
        self._stopping = threading.Event()
        self._following = asyncio.get_running_loop().run_in_executor(
            self._compute, follow_seat, self.source, route.stages[index], rank, keypair, bind,
            int(route.plan_version), self._stopping)

    async def take_seat(self, route: Route, seat: tuple[int, int], keypair, bind: str) -> None:
        """This device's seat in a tensor group of ``route``: (stage index, rank); rank 0 leads it."""
        if not bind or keypair is None:
            raise StageError("no_stage", "this device takes no tensor group's links (no group port, or no CURVE keys)")
        index, rank = seat
        if rank == 0:
            await self.lead_group(route, index, keypair, bind)
        else:  # its layers are the first member's stage: this device computes its share beside it
            await self.follow_group(route, index, rank, keypair, bind)

    def group_lost(self, exc: BaseException) -> None:
        """A pass found the group gone: serve nothing until the next plan (requests wait for it and replay,
        instead of failing at once on the same group again and again)."""
        if not self.in_group:
            return
        log.warning("tensor_group_lost", error=str(exc))
        leaving = asyncio.get_running_loop().create_task(self.leave_group())
        self._leaving.add(leaving)
        leaving.add_done_callback(self._leaving.discard)

    async def aclose(self) -> None:
        """Out of a tensor group first (the compute thread may be following another member), then closed."""
        try:
            await asyncio.wait_for(self.leave_group(), 10.0)
        except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - stopping anyway
            log.warning("tensor_group_leave_failed", error=f"{type(exc).__name__}: {exc}")
        self.close()

    async def leave_group(self) -> None:
        """Out of the group this device was in (the first member tells the others; a follower stops)."""
        stage = self.stage
        if isinstance(stage, GroupedStage):  # this device led a group
            self.stage = None
            stage.abort("the first member left the group (a new plan)")  # a pass waiting on the others ends
            await self.in_compute(stage.close)
        if self._following is not None:
            self._stopping.set()
            following, self._following = self._following, None
            try:
                await following
            except Exception as exc:  # noqa: BLE001 - the group was already gone; the new plan goes on
                log.warning("tensor_group_follow_failed", error=f"{type(exc).__name__}: {exc}")

    @property
    def in_group(self) -> bool:
        return self._following is not None or isinstance(self.stage, GroupedStage)

    # -- one pass -------------------------------------------------------------------------------
    def input_of(self, msg: StageForward) -> tuple[torch.Tensor, DraftTree | None]:
        """The message's payload, checked against this stage before anything changes: token ids first,
        hidden states after, and a verify round's token tree."""
        x = self._input(msg)
        return x, tree_of(msg, x) if msg.verify else None

    def _input(self, msg: StageForward) -> torch.Tensor:
        stage = self.stage
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

    def work_for(self, msg: StageForward, slot: SeqSlot, x: torch.Tensor, tree: DraftTree | None) -> Work:
        """The message's share of the next pass."""
        want_logits = self.stage.is_last and msg.is_last_chunk
        mask = tree.mask() if tree is not None else msg.tree_mask
        normed = want_logits and (msg.verify or msg.medusa_paths > 0)
        # Early exits only where the answer is the model's own distribution, drawn once: a plain decode step
        # of a sequence without grammar or penalties (a decode step's message carries the unshaped spec; the
        # shaping the last prompt chunk brought lives in the slot's selector).
        plain = not msg.sampling.shaped and (slot.selector is None or slot.selector.plain)
        exits = want_logits and plain and not msg.verify and msg.return_topk == 0 and msg.medusa_paths == 0
        # The head's rows when read, over the grammar's tokens: a verify round reads only the rows it walks,
        # a grammar often allows a few hundred of 150k tokens (the sampler asks; a verifier's top-k needs all).
        grammar = msg.sampling.constraint is not None or (slot.selector is not None and
                                                          slot.selector.constraint is not None)
        lazy = want_logits and (msg.verify or grammar) and msg.return_topk == 0 and not exits
        # A greedy step that nothing but the argmax reads (no grammar or penalties, no verify round, Medusa
        # or verifier top-k): a tensor group sends each member's best token, not its share of the row. (An
        # early exit reads its own head, and a group takes none.)
        params = slot.selector.sampler.params if slot.selector is not None else msg.sampling.params
        best = want_logits and plain and params.greedy and not msg.verify and not normed and msg.return_topk == 0
        item = BatchItem(slot.seq, x, mask, all_logits=msg.verify, head=want_logits, return_normed=normed,
                         attention_tail=max(0, min(int(msg.attention_tail), 64)) if want_logits else 0,
                         exit_threshold=min(max(float(msg.exit_threshold), 0.0), 1.0) if exits else 0.0,
                         lazy_head=lazy, best_only=best)
        return Work(msg, slot, item, tree, want_logits, normed)

    async def run(self, stage: StageModel, kv, works: list[Work],
                  answer: Callable[[StageModel, Work, Any, torch.Tensor | None], Any]
                  ) -> tuple[list[Outcome], ExitFill | None]:
        """One forward for ``works`` in the compute thread; ``answer`` turns a last-stage output into a
        result there too (the sampler). Returns the outcomes, and the fill of the layers exited rows
        skipped when some did (await it with :meth:`filled`)."""
        outcomes = await asyncio.get_running_loop().run_in_executor(
            self._compute, self._compute_group, stage, kv, works, answer)
        return outcomes, self._fill_soon(stage, kv, works, outcomes)

    def _fill_soon(self, stage: StageModel, kv, works: list[Work], outcomes: list[Outcome]) -> ExitFill | None:
        """Queue, in the compute thread, the layers that exited rows skipped (None: none did).

        Queued before the pass's answers go out, so nothing that answer sets off (a
        next step, a prefix kept) can reach this sequence's cache before it is whole."""
        if not stage.has_pending():
            return None

        def fill() -> tuple[list, float]:
            t = time.perf_counter()
            return stage.fill_pending(kv), time.perf_counter() - t

        future = asyncio.get_running_loop().run_in_executor(self._compute, fill)
        exited = [w for w, (out, _) in zip(works, outcomes) if getattr(out, "exit_layer", 0)]
        for w in exited:
            self._filling[w.slot.seq] = future
        return ExitFill(future, exited)

    async def filled(self, fill: ExitFill) -> tuple[list[Work], float]:
        """Wait for ``fill``: the exited messages whose caches are not whole (a fill failed: those requests
        replay), and the seconds it computed."""
        try:
            broken, seconds = await fill.future
        except Exception as exc:  # noqa: BLE001 - the executor itself failed: nobody's cache is whole
            broken, seconds = [w.slot.seq for w in fill.works], 0.0
            log.warning("exit_fill_failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            for w in fill.works:
                self._filling.pop(w.slot.seq, None)
        return [w for w in fill.works if w.slot.seq in broken], seconds

    async def wait_fill(self, seq: SeqKey) -> None:
        """Until the layers ``seq``'s exited row skipped are computed (at once when none are owed)."""
        filling = self._filling.get(seq)
        if filling is not None:
            await asyncio.wait([filling])

    async def in_compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the compute thread, between passes (work on the KV cache's buffers)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def _compute_group(self, stage: StageModel, kv, works: list[Work], answer) -> list[Outcome]:
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
            return [self._compute_group(stage, kv, [w], answer)[0] for w in works]
        results: list[Outcome] = []
        for i, (w, out) in enumerate(zip(works, outs)):
            try:
                results.append((answer(stage, w, out, probes.get(i)) if w.want_logits else out, None))
            except Exception as exc:  # noqa: BLE001 - reported per message by the caller
                results.append((None, exc))
        return results
