"""Drive generation requests through the pipeline stages of the current route.

The coordinator is whichever daemon received the request. It injects the
prompt's sub-sequences back to back into the first stage (stage i then works
on chunk j while stage i+1 works on chunk j-1), waits for the last stage's
sampled token, and feeds each new token back in. Many requests may be in
flight at once: each has its own sequence id in every stage's cache, and the
stages interleave their messages, so the devices stay busy.

A request fails — never hangs — when a stage reports an error, when the mesh
re-plans under it (a member left or joined), or when no token arrives within
the token timeout. Its KV cache is then freed on every stage still reachable.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from decoding.pipeline_local import chunk_bounds
from decoding.sampling import SamplingParams
from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.pipeline.route import Route
from transport.errors import TransportError
from meshd.pipeline.links import Directory, Links
from transport.link import Request
from transport.messages import Ack, ErrorReply, FreeSequence, Hello, StageForward, TokenResult
from transport.node import TransportNode

log = get_logger("meshd.coordinator")

class PipelineError(MeshdError):
    """A request could not be completed by the pipeline (the message says where and why)."""


class NoRoute(PipelineError):
    pass


@dataclass(frozen=True)
class TokenStep:
    token: int
    topk_ids: list[int] | None = None
    topk_probs: list[float] | None = None


@dataclass
class _Flight:
    request_id: str
    route: Route
    queue: asyncio.Queue


class PipelineCoordinator:
    def __init__(self, node: TransportNode, node_id: str, directory: Directory,
                 token_timeout_s: float = 30.0, send_timeout_s: float = 10.0,
                 activation_dtype: str | None = None):
        self.node = node
        self.node_id = node_id
        self.directory = directory
        self.token_timeout_s = token_timeout_s
        self.send_timeout_s = send_timeout_s
        self.activation_dtype = activation_dtype
        self.route: Route | None = None
        self.address: str | None = None
        self._server = None
        self._flights: dict[str, _Flight] = {}
        self._seq_ids = itertools.count(1)
        self.links = Links(node, directory)
        self._ready_version = 0

    async def start(self, address: str = "tcp://127.0.0.1:0", advertise_host: str | None = None) -> str:
        """Bind; ``advertise_host`` is the address last stages use to reach us (when binding 0.0.0.0)."""
        self._server = await self.node.serve(self._on_message, address)
        self.address = self._server.address
        if advertise_host:
            self.address = f"tcp://{advertise_host}:{self.address.rsplit(':', 1)[1]}"
        return self.address

    async def close(self) -> None:
        for f in list(self._flights.values()):
            f.queue.put_nowait(PipelineError("the coordinator is shutting down"))
        await self.links.close()
        if self._server is not None:
            await self._server.close()

    @property
    def reply_to(self) -> str:
        return f"{self.node_id}|{self.address}"

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def set_route(self, route: Route | None) -> None:
        """A new plan: requests still running on the old one fail with a clear error."""
        old, self.route = self.route, route
        if old is not None and (route is None or route.plan_version != old.plan_version):
            for f in list(self._flights.values()):
                if f.route.plan_version == old.plan_version:
                    f.queue.put_nowait(PipelineError(
                        f"the mesh re-planned (plan {old.plan_version} -> "
                        f"{route.plan_version if route else 'none'}) while this request ran; retry it"))

    # -- incoming ------------------------------------------------------------------
    async def _on_message(self, msg, req: Request):
        rid = getattr(msg, "request_id", "")
        flight = self._flights.get(rid)
        if isinstance(msg, (TokenResult, ErrorReply)):
            if flight is None:
                log.debug("late_result_dropped", request_id=rid, message_type=type(msg).__name__)
            else:
                flight.queue.put_nowait(msg)
            return Ack()
        log.warning("coordinator_unexpected_message", message_type=type(msg).__name__)
        return ErrorReply("unknown_type", f"the coordinator does not handle {type(msg).__name__}")

    # -- outgoing ------------------------------------------------------------------
    async def _send(self, node_id: str, msg) -> None:
        peer = await self.links.to(node_id)
        await peer.send(msg, timeout=self.send_timeout_s, activation_dtype=self.activation_dtype)

    async def wait_ready(self, route: Route, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        """Wait until every stage of ``route`` has loaded its layers for that plan version.

        After a re-plan, stages may still be loading weights; a request arriving
        then waits (bounded) instead of failing on a half-deployed pipeline.
        """
        if self._ready_version == route.plan_version:
            return
        async with asyncio.timeout(timeout_s):
            for st in route.stages:
                while True:
                    if self.route is not route:  # re-planned (e.g. a stage's device left): stop waiting
                        raise PipelineError(f"the mesh re-planned while waiting for plan "
                                            f"{route.plan_version}'s stages to load; retry")
                    try:
                        peer = await self.links.to(st.node_id)
                        reply = await peer.request(Hello(self.node_id, route.plan_version, ""), timeout=5.0)
                        if reply.plan_version == route.plan_version:
                            break
                        if reply.plan_version > route.plan_version:
                            raise PipelineError(f"stage {st.node_id} already runs a newer plan "
                                                f"({reply.plan_version} > {route.plan_version}); retry")
                    except TransportError as exc:
                        log.info("stage_not_ready", node=st.node_id, error=str(exc))
                    await asyncio.sleep(poll_s)
        self._ready_version = route.plan_version
        log.info("pipeline_ready", plan_version=route.plan_version, stages=[s.node_id for s in route.stages])

    # -- the request loop ------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       sampling: SamplingParams, eos_ids=(), cuts: list[int] | None = None,
                       chunks: int | None = None) -> AsyncIterator[int]:
        """Yield sampled token ids (EOS included, as the last one) for one request."""
        async for step in self.steps(request_id, prompt_ids, max_tokens, sampling, eos_ids, cuts, chunks):
            yield step.token

    async def steps(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                    sampling: SamplingParams, eos_ids=(), cuts: list[int] | None = None,
                    chunks: int | None = None, return_topk: int = 0) -> AsyncIterator["TokenStep"]:
        """Like :meth:`generate`, with each step's top-k probabilities when ``return_topk`` > 0.

        Only the k ids and probabilities travel back from the last stage — never full logits.
        """
        route = self.route
        if route is None or not route.stages:
            raise NoRoute("no pipeline plan is deployed on this mesh yet")
        if request_id in self._flights:
            raise PipelineError(f"request id {request_id!r} is already running")
        flight = _Flight(request_id, route, asyncio.Queue())
        self._flights[request_id] = flight
        seq = next(self._seq_ids)
        first = route.stages[0].node_id
        base = {"capacity": len(prompt_ids) + max_tokens, **sampling.to_dict()}
        if return_topk:
            base["return_topk"] = int(return_topk)
        pos = 0
        try:
            bounds = chunk_bounds(len(prompt_ids), chunks, cuts)
            for j, (a, b) in enumerate(bounds):
                await self._send(first, StageForward(
                    request_id=request_id, plan_version=route.plan_version, seq_id=seq,
                    position_offset=a, chunk_index=j,
                    token_ids=torch.tensor(prompt_ids[a:b], dtype=torch.long),
                    sampling=base, reply_to=self.reply_to, is_last_chunk=j == len(bounds) - 1))
            pos = len(prompt_ids)
            for i in range(max_tokens):
                step = await self._next_step(flight)
                token = step.token
                yield step
                if token in eos_ids or i + 1 == max_tokens:
                    break
                await self._send(first, StageForward(
                    request_id=request_id, plan_version=route.plan_version, seq_id=seq,
                    position_offset=pos, chunk_index=0,
                    token_ids=torch.tensor([token], dtype=torch.long),
                    sampling=base, reply_to=self.reply_to, is_last_chunk=True))
                pos += 1
        except TransportError as exc:
            raise PipelineError(f"pipeline link failed: {exc}") from exc
        finally:
            self._flights.pop(request_id, None)
            await self._free(route, seq)

    async def _next_step(self, flight: _Flight) -> "TokenStep":
        try:
            item = await asyncio.wait_for(flight.queue.get(), self.token_timeout_s)
        except TimeoutError:
            raise PipelineError(
                f"no token from the last stage within {self.token_timeout_s:g}s "
                f"(route {[s.node_id for s in flight.route.stages]}); a device may have left") from None
        if isinstance(item, Exception):
            raise item
        if isinstance(item, ErrorReply):
            raise PipelineError(f"stage failed ({item.code}): {item.message}")
        return TokenStep(int(item.token_ids[0]),
                         item.topk_ids.tolist() if item.topk_ids is not None else None,
                         item.topk_probs.tolist() if item.topk_probs is not None else None)

    async def _free(self, route: Route, seq: int) -> None:
        """Release the request's cache on every stage (directly: the chain may be broken)."""
        async def one(node_id):
            try:
                await asyncio.wait_for(self._send(node_id, FreeSequence(route.plan_version, seq)), 2.0)
            except (TransportError, TimeoutError, KeyError) as exc:
                log.info("free_unreachable", node=node_id, seq_id=seq, error=str(exc))
        await asyncio.gather(*(one(s.node_id) for s in route.stages))
