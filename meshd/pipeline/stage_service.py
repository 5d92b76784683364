"""Serve this device's pipeline stage over the transport.

One service per daemon. It owns the stage's weights (only its layer range),
its KV cache (one sequence per in-flight request) and one compute thread.
Messages are handled strictly in arrival order: chunk j+1 of a prompt needs
chunk j's keys/values in the cache, and a rollback must land before the next
forward. While the compute thread works on one chunk, the next chunks queue
in ZeroMQ, and the previous result is already travelling to the next stage —
that overlap is the intra-sequence pipeline.

Failures never stay local: if a forward fails here (stale plan, cache full,
position mismatch) the coordinator named in the message gets an ErrorReply
for that request at once, instead of waiting for a token that will not come.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from decoding.sampling import Sampler, SamplingParams, filtered_probs
from decoding.stage import StageModel
from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.pipeline.links import Directory, Links
from meshd.pipeline.route import Route
from transport.errors import TransportError
from transport.link import Request, StageServer
from transport.messages import (Ack, ErrorReply, ForkSequence, FreeSequence, Hello, HelloReply, StageForward,
                                TokenResult, Truncate)
from transport.node import TransportNode

log = get_logger("meshd.stage")

class StageError(MeshdError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class StageStats:
    forwards: int = 0
    tokens: int = 0
    activation_bytes_out: int = 0
    busy_s: float = 0.0
    errors: int = 0
    started: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict:
        up = max(time.monotonic() - self.started, 1e-9)
        return {"forwards": self.forwards, "tokens": self.tokens, "busy_s": round(self.busy_s, 3),
                "activation_bytes_out": self.activation_bytes_out,
                "utilisation": round(self.busy_s / up, 3), "errors": self.errors}


class StageService:
    def __init__(self, node: TransportNode, node_id: str, model_source, directory: Directory,
                 dtype: torch.dtype = torch.float32, max_kv_tokens: int = 1 << 16,
                 activation_dtype: str | None = None, send_timeout_s: float = 5.0):
        self.node = node
        self.node_id = node_id
        self.source = model_source
        self.directory = directory
        self.dtype = dtype
        self.max_kv_tokens = max_kv_tokens
        self.activation_dtype = activation_dtype
        self.send_timeout_s = send_timeout_s
        self.route: Route | None = None
        self.index: int | None = None
        self.stage: StageModel | None = None
        self.kv = None
        self.samplers: dict[int, Sampler] = {}
        self.stats = StageStats()
        self.server: StageServer | None = None
        self.links = Links(node, directory)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self._deploy_lock = asyncio.Lock()

    # -- lifecycle --------------------------------------------------------------
    async def start(self, address: str = "tcp://127.0.0.1:0") -> str:
        self.server = await self.node.serve(self.handle, address, ordered=True)
        return self.server.address

    async def close(self) -> None:
        await self.links.close()
        if self.server is not None:
            await self.server.close()
        self._compute.shutdown(wait=False, cancel_futures=True)

    async def deploy(self, route: Route) -> None:
        """Adopt a new plan: load this node's layer range (reusing weights if unchanged).

        Every plan change drops all sequences: their caches were built under the
        old partition and the requests using them fail with a stale-plan error.
        """
        async with self._deploy_lock:
            idx = route.index_of(self.node_id)
            rng = (route.stages[idx].first, route.stages[idx].last) if idx is not None else None
            if rng is None:
                self.stage, self.kv = None, None
            elif self.stage is None or (self.stage.first, self.stage.last) != rng:
                log.info("stage_loading", plan_version=route.plan_version, first=rng[0], last=rng[1])
                t = time.perf_counter()
                loop = asyncio.get_running_loop()
                self.stage = await loop.run_in_executor(
                    self._compute, lambda: self.source.load_stage(rng[0], rng[1], self.dtype))
                log.info("stage_loaded", first=rng[0], last=rng[1], seconds=round(time.perf_counter() - t, 2),
                         weight_mb=round(self.stage.weight_bytes() / 1e6, 1))
            if self.stage is not None:
                self.kv = self.stage.new_cache(self.max_kv_tokens)
            self.samplers.clear()
            self.route, self.index = route, idx

    # -- message handling ------------------------------------------------------------
    async def handle(self, msg: Any, req: Request) -> Any:
        try:
            if isinstance(msg, Hello):  # readiness probe: which plan is loaded and serving here
                version = self.route.plan_version if self.route is not None and self.stage is not None else 0
                return HelloReply(self.node_id, version, "")
            if isinstance(msg, StageForward):
                await self._forward(msg)
            elif isinstance(msg, (Truncate, FreeSequence, ForkSequence)):
                self._check_plan(msg.plan_version)
                self._control(msg)
                if not isinstance(msg, FreeSequence):  # the coordinator frees every stage itself
                    await self._pass_on(msg)
            else:
                raise StageError("unknown_type", f"a stage does not handle {type(msg).__name__}")
        except (StageError, MeshdError, TransportError) as exc:
            self.stats.errors += 1
            code = getattr(exc, "code", "stage")
            rid = getattr(msg, "request_id", "")
            log.warning("stage_error", code=code, error=str(exc), request_id=rid,
                        message_type=type(msg).__name__)
            reply_to = getattr(msg, "reply_to", "")
            if reply_to:
                await self._report(reply_to, ErrorReply(code, f"{self.node_id}: {exc}", rid))
            if isinstance(msg, StageForward) and self.kv is not None and msg.seq_id in self.kv:
                self.kv.free(msg.seq_id)  # a request that failed here is dead everywhere
            raise
        return Ack(self.route.plan_version if self.route else 0)

    def _check_plan(self, version: int) -> None:
        if self.route is None or self.stage is None:
            raise StageError("no_stage", "this device serves no stage in the current plan")
        if version != self.route.plan_version:
            raise StageError("stale_plan",
                             f"message for plan {version}, this stage runs plan {self.route.plan_version}")

    async def _forward(self, msg: StageForward) -> None:
        self._check_plan(msg.plan_version)
        stage, kv = self.stage, self.kv
        seq = msg.seq_id
        if seq not in kv:
            if msg.position_offset != 0:
                raise StageError("unknown_sequence", f"sequence {seq} is not in this stage's cache "
                                                     f"(offset {msg.position_offset})")
            kv.create(seq, max(int(msg.sampling.get("capacity", 0)), 16))
        if kv.length(seq) != msg.position_offset:
            raise StageError("position_mismatch", f"sequence {seq} holds {kv.length(seq)} positions, "
                                                  f"message starts at {msg.position_offset}")
        if stage.is_first:
            if msg.token_ids is None:
                raise StageError("bad_input", "the first stage needs token_ids")
            x = msg.token_ids.to(torch.long)
        else:
            if msg.hidden is None or msg.hidden.ndim != 2 or msg.hidden.shape[1] != stage.config.hidden_size:
                raise StageError("bad_input", f"expected hidden states [n, {stage.config.hidden_size}]")
            x = msg.hidden
        want_logits = stage.is_last and msg.is_last_chunk
        t = time.perf_counter()
        out = await asyncio.get_running_loop().run_in_executor(
            self._compute, lambda: stage.forward(kv, seq, x, tree_mask=msg.tree_mask, all_logits=False,
                                                 head=want_logits))
        self.stats.busy_s += time.perf_counter() - t
        self.stats.forwards += 1
        self.stats.tokens += x.shape[0]
        if not stage.is_last:
            nxt = StageForward(
                request_id=msg.request_id, plan_version=msg.plan_version, seq_id=seq,
                position_offset=msg.position_offset, chunk_index=msg.chunk_index, hidden=out,
                tree_mask=msg.tree_mask, sampling=msg.sampling, reply_to=msg.reply_to,
                is_last_chunk=msg.is_last_chunk)
            await self._send_next(nxt)
            elem = 2 if self.activation_dtype in ("float16", "bfloat16") else out.element_size()
            self.stats.activation_bytes_out += out.numel() * elem
        elif want_logits:
            sampler = self.samplers.get(seq)
            if sampler is None:
                sp = {k: msg.sampling[k] for k in ("temperature", "top_k", "top_p", "seed") if k in msg.sampling}
                sampler = self.samplers[seq] = Sampler(SamplingParams(**sp))
            token = sampler(out[-1])
            topk_ids = topk_probs = None
            k = int(msg.sampling.get("return_topk", 0) or 0)
            if k > 0:  # the compressed distribution a verifier needs, instead of 49k logits
                probs = (torch.softmax(out[-1].float(), -1) if sampler.params.greedy
                         else filtered_probs(out[-1], sampler.params))
                top = torch.topk(probs, min(k, probs.shape[-1]))
                topk_ids, topk_probs = top.indices.to(torch.int64), top.values.to(torch.float32)
            await self._report(msg.reply_to, TokenResult(
                request_id=msg.request_id, plan_version=msg.plan_version, seq_id=seq,
                token_ids=torch.tensor([token], dtype=torch.long), chunk_index=msg.chunk_index,
                topk_ids=topk_ids, topk_probs=topk_probs))

    def _control(self, msg) -> None:
        kv = self.kv
        if isinstance(msg, FreeSequence):
            kv.free(msg.seq_id)
            self.samplers.pop(msg.seq_id, None)
        elif isinstance(msg, Truncate):
            kv.truncate(msg.seq_id, msg.new_length)
        elif isinstance(msg, ForkSequence):
            kv.fork(msg.parent_id, msg.seq_id, msg.prefix_length)

    async def _pass_on(self, msg) -> None:
        if self.route.next_after(self.index) is not None:
            await self._send_next(msg)

    # -- links ----------------------------------------------------------------------------
    async def _send_next(self, msg) -> None:
        nxt = self.route.next_after(self.index)
        peer = await self.links.to(nxt.node_id)
        await peer.send(msg, timeout=self.send_timeout_s, activation_dtype=self.activation_dtype)

    async def _report(self, reply_to: str, msg) -> None:
        """Send to a coordinator; ``reply_to`` is "node_id|address" (its key comes from the directory)."""
        node_id, _, address = reply_to.partition("|")
        try:
            peer = await self.links.to(node_id, address)
            await peer.send(msg, timeout=self.send_timeout_s)
        except (TransportError, KeyError) as exc:
            log.warning("report_failed", to=reply_to, error=str(exc), message_type=type(msg).__name__)
