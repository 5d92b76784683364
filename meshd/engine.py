"""The seam between the client API and whatever produces tokens.

The API layer only knows :class:`Engine`: a tokenizer, a context length, a
model id, and :meth:`Engine.stream`, which turns a :class:`GenerationRequest`
into :class:`TokenEvent` values. Engines (the whole model on this device, the
cross-daemon pipeline, a test fake) implement one small method,
:meth:`Engine.token_ids`, that yields raw token ids. Everything that must
behave identically whatever the engine — incremental detokenisation, stop
strings (never emitted), EOS, ``max_tokens``, finish reasons, usage — lives
here, once, in :meth:`Engine.stream`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from decoding.detok import IncrementalDetokenizer  # re-exported: the API layer streams with it
from decoding.sampling import SamplingSpec
from decoding.speculative.params import SpeculativeParams, SpeculativeStats
from meshd.errors import USER_ERRORS, MeshdError
from meshd.log import get_logger
from partition.ids import RequestId

log = get_logger("meshd.engine")


# --------------------------------------------------------------------------- errors


_CLASS_DEFAULT: Any = object()


class EngineError(MeshdError):
    """A generation could not be served; ``http_status`` is what the API answers.

    ``retry_after_s`` (None: retrying will not help) becomes the API's
    ``Retry-After`` header, so clients back off instead of hammering a mesh
    that is re-planning or full. Subclasses set a default; a raiser that knows
    better (e.g. when a cache slot frees) passes ``retry_after_s=``.
    """

    http_status = 500
    error_type = "server_error"
    code: str | None = "generation_failed"
    retry_after_s: float | None = None

    def __init__(self, *args: Any, retry_after_s: float | None = _CLASS_DEFAULT):
        super().__init__(*args)
        if retry_after_s is not _CLASS_DEFAULT:
            self.retry_after_s = retry_after_s


class PromptTooLong(EngineError):
    """The prompt alone fills the model's context (or the cache the plan allows)."""

    http_status = 413
    error_type = "invalid_request_error"
    code = "context_length_exceeded"


class NoPlan(EngineError):
    """No partition of the model fits the devices currently in the mesh."""

    http_status = 503
    error_type = "service_unavailable"
    code = "no_plan"
    retry_after_s = 2.0  # devices join and plans settle within seconds


class EngineUnavailable(EngineError):
    """No engine can take requests right now (model loading, mesh re-planning)."""

    http_status = 503
    error_type = "service_unavailable"
    code = "engine_unavailable"
    retry_after_s = 2.0


class EngineBusy(EngineError):
    """The mesh is full right now (KV cache exhausted, too many requests in flight).

    Unlike :class:`NoPlan` the mesh is healthy: the same request succeeds once
    a running generation ends, so clients are told to retry soon.
    """

    http_status = 503
    error_type = "service_unavailable"
    code = "busy"
    retry_after_s = 1.0


class BadEngineRequest(EngineError):
    """The request asks for something this engine cannot do (e.g. a drafter it does not have)."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "unsupported"


class BadTokenIds(EngineError):
    """The prompt holds token ids the model has no embedding for (caught before any stage sees them)."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_token_ids"


class WrongModel(EngineError):
    """This device holds another model than the one its home serves: it refuses to answer
    (an answer would come from the wrong weights). Retrying does not help until it is restarted."""

    http_status = 409
    error_type = "conflict"
    code = "model_mismatch"


def out_of_vocab(ids: Sequence[int], vocab_size: int | None) -> str:
    """Why ``ids`` cannot be fed to a model of ``vocab_size`` tokens ("" if they can; None/0: unknown)."""
    if not vocab_size:
        return ""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is None:
        return ""
    return f"token id {ids[bad]} at position {bad} is outside the model's vocabulary [0, {vocab_size})"


class GenerationFailed(EngineError):
    """A generation broke half way (a device left, the runtime raised)."""

    http_status = 500
    error_type = "server_error"
    code = "generation_failed"


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    speculative: SpeculativeStats | None = None  # how speculation went (None: not attempted)
    cloud: dict[str, Any] | None = None  # how a cloud verifier was used (None: it was not)
    outline: dict[str, Any] | None = None  # how an outline attempt went (None: none was attempted)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.speculative is not None:
            d["speculative"] = self.speculative.to_dict()
        if self.cloud is not None:
            d["cloud"] = dict(self.cloud)
        if self.outline is not None:
            d["outline"] = dict(self.outline)
        return d


@dataclass
class GenerationRequest:
    """One generation, already tokenised by the API layer.

    ``prompt_ids`` is authoritative; ``messages`` is kept for engines that want
    the conversation (e.g. to log it, or to forward it to a cloud helper).
    ``max_tokens`` is the resolved budget (the API clips it to the context).
    ``sampling`` is the one :class:`decoding.sampling.SamplingSpec` (the draw,
    penalties, a grammar) that reaches the sampler unchanged; its default is
    greedy (the API maps OpenAI's default temperature of 1.0 itself, in
    ``meshd.api.openai_schema``). The API sends a grammar only to engines with
    ``supports_constraints`` and active penalties only to those with
    ``supports_penalties``.
    """

    request_id: RequestId
    prompt_ids: list[int]
    max_tokens: int
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)
    # Filled in by the engine as it runs: how speculation went (reported in usage).
    speculative_stats: SpeculativeStats | None = None
    # Tools were offered (their calls may be parsed from free text even without a constraint).
    tools_offered: bool = False
    # Outline-based parallel decoding: "auto" (meshd.pipeline.outline_gate decides), "on" or "off";
    # engines with ``supports_outline`` honour it. Filled in by the engine: whether it was used,
    # and how an attempt went (reported in usage).
    outline: str = "auto"
    outline_used: bool = False
    outline_stats: dict[str, Any] | None = None
    # A paired cloud verifier: "auto" (use it at the daemon's budget), "off", or a budget in [0, 1].
    # Filled in by the engine: how the offloading went (reported in usage).
    cloud: str | float = "auto"
    cloud_stats: dict[str, Any] | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One step of a generation.

    Every generated token gives one event (``text`` may be empty while a
    multi-byte character or a possible stop string is held back). The last
    event has ``finish_reason`` ("stop" or "length"), ``usage``, no token id,
    and whatever text was still held back.
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None


class Tokenizer(Protocol):
    eos_ids: Sequence[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


# --------------------------------------------------------------------------- text helpers


class StopMatcher:
    """Cuts generated text at the first stop string, which is never emitted.

    Text that could be the start of a stop string is held back until the next
    delta proves it is not, so a client never sees half of a stop string.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Return the text that is now safe to emit; sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        buf = self._held + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


# --------------------------------------------------------------------------- engine


class Engine(abc.ABC):
    """Produces tokens for the API. Subclasses implement :meth:`token_ids`."""

    model_id: str
    context_length: int
    tokenizer: Tokenizer
    # What the engine honours beyond plain sampling. The API answers 400 to a request
    # that needs a capability its engine lacks, instead of silently ignoring it.
    supports_constraints: bool = False  # GenerationRequest.sampling.constraint (structured output)
    supports_penalties: bool = False  # GenerationRequest.sampling.penalties

    @abc.abstractmethod
    def token_ids(self, req: GenerationRequest) -> AsyncIterator[int]:
        """Yield generated token ids for ``req`` (at most ``req.max_tokens``).

        May raise :class:`EngineError` subclasses before the first id (no plan,
        prompt too long for the plan's cache) or later (a device left). When
        the consumer stops early the iterator is closed (``aclose``): the
        engine must then stop computing for this request.
        """

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_ids or ())

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise :class:`BadTokenIds` for an id outside the vocabulary (whatever made it: a client's
        token array, a tokenizer that does not match the weights), :class:`PromptTooLong` if no
        token could be generated after it."""
        bad = out_of_vocab(prompt_ids, getattr(self, "vocab_size", None))
        if bad:
            raise BadTokenIds(bad)
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLong(
                f"prompt is {len(prompt_ids)} tokens; the model's context is "
                f"{self.context_length} tokens and at least one must be left to answer"
            )

    async def stream(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Text events for ``req``; the one place stop strings and EOS are applied."""
        self.check_prompt(req.prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(req.stop)
        eos = self.eos_ids
        produced = 0
        finish = "length"
        async with contextlib.aclosing(self.token_ids(req)) as ids:
            async for tid in ids:
                if tid in eos:
                    finish = "stop"
                    break
                produced += 1
                text = stops.feed(detok.push(tid))
                if stops.stopped:
                    finish = "stop"
                    yield TokenEvent(tid, text)
                    break
                yield TokenEvent(tid, text)
                if produced >= req.max_tokens:
                    finish = "length"
                    break
            else:
                # The engine ended without EOS before the budget: treat as a
                # natural stop (e.g. the engine's own end-of-context).
                finish = "stop" if produced < req.max_tokens else "length"
        tail = "" if stops.stopped else stops.feed(detok.flush()) + stops.flush()
        yield TokenEvent(None, tail, finish, Usage(len(req.prompt_ids), produced, req.speculative_stats,
                                                         req.cloud_stats, req.outline_stats))


# --------------------------------------------------------------------------- threads


async def iterate_in_thread(
    make_iter, *, executor=None, cancel: threading.Event | None = None
) -> AsyncIterator[Any]:
    """Run a blocking iterator in a worker thread and yield its items here.

    ``make_iter(cancel)`` is called in the worker and must return an iterator
    that checks ``cancel`` between items (torch work cannot be interrupted
    mid-kernel). Closing the async generator sets ``cancel`` and waits for the
    worker to notice, so an abandoned request stops using the CPU and the next
    request never overlaps it.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = cancel or threading.Event()
    done = object()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # loop closed while the worker was finishing
            pass

    def work() -> None:
        try:
            it: Iterator[Any] = make_iter(cancel)
            for item in it:
                put(("item", item))
                if cancel.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            put(("error", exc))
        finally:
            put(("done", done))

    future = loop.run_in_executor(executor, work)
    try:
        while True:
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                break
    finally:
        cancel.set()
        # Shielded so that a cancelled consumer still waits for the worker to
        # stop before the next generation may start on the same thread/model.
        with contextlib.suppress(BaseException):
            await asyncio.shield(future)


# --------------------------------------------------------------------------- local


def model_id_of(source) -> str:
    """A readable model id for ``/v1/models``: the file (or directory) name without extension."""
    from pathlib import Path

    path = Path(getattr(source, "path", "") or "model")
    return path.stem if path.suffix == ".gguf" else path.name


class LocalEngine(Engine):
    """The whole model on this device, using the reference runtime in ``decoding``.

    torch work runs in one dedicated worker thread (so the event loop keeps
    serving status and other clients) and tokens come back through an asyncio
    queue. One generation runs at a time; later requests wait their turn on a
    lock, in arrival order. Constructing it loads the weights (blocking; use
    :meth:`open` from async code).
    """

    supports_penalties = True

    def __init__(self, source, *, dtype=None, max_context: int | None = None, stages: int = 1, device=None):
        """``device``: where the model runs (default the CPU); ``dtype`` None: that device's default."""
        import concurrent.futures

        from decoding.pipeline_local import LocalPipeline

        self.source = source
        self.tokenizer = source.tokenizer
        self.model_id = model_id_of(source)
        self.vocab_size = source.config.vocab_size
        ctx = source.config.max_position
        self.context_length = min(ctx, max_context) if max_context else ctx
        self._pipeline = LocalPipeline.from_source(source, stages, dtype, device)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshd-generate")
        self._lock = asyncio.Lock()

    @property
    def supports_constraints(self) -> bool:
        """The grammar library reads the vocabulary from the model's tokenizer.json."""
        return getattr(self.tokenizer, "path", None) is not None

    @classmethod
    async def open(cls, path=None, **kw) -> LocalEngine:
        """Open ``path`` (None: the embedded default model) and load it off the event loop."""
        from meshd.model_store import open_model

        return await asyncio.to_thread(lambda: cls(open_model(path), **kw))

    async def token_ids(self, req: GenerationRequest) -> AsyncIterator[int]:
        from decoding.errors import ContextOverflow

        async with self._lock:
            log.debug("generation_start", request_id=req.request_id, prompt_tokens=len(req.prompt_ids))
            try:
                async for tid in iterate_in_thread(
                    lambda cancel: self._generate(req, cancel), executor=self._executor
                ):
                    yield tid
            except ContextOverflow as exc:
                raise PromptTooLong(str(exc)) from exc
            except EngineError:
                raise
            except USER_ERRORS as exc:
                raise GenerationFailed(str(exc)) from exc
            except Exception as exc:  # noqa: BLE001 - a runtime bug must not kill the daemon
                log.exception("generation_failed", request_id=req.request_id)
                raise GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}") from exc

    def _generate(self, req: GenerationRequest, cancel: threading.Event) -> Iterator[int]:
        """Blocking token loop (worker thread); checks ``cancel`` before each forward."""
        import torch

        from decoding.selector import TokenSelector

        eos = self.eos_ids
        select = TokenSelector.for_spec(req.sampling, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                        prompt_tail=req.prompt_ids)
        pipe, seq = self._pipeline, req.request_id
        pipe.create(seq, len(req.prompt_ids) + req.max_tokens)
        try:
            with torch.inference_mode():
                logits = pipe.prefill(seq, list(req.prompt_ids))
                for i in range(req.max_tokens):
                    tok = select(logits[-1])
                    yield tok
                    if tok in eos or i + 1 >= req.max_tokens or cancel.is_set():
                        return
                    if select.finished:
                        yield min(eos)  # the grammar is complete: nothing else may follow
                        return
                    logits = pipe.forward(seq, torch.tensor([tok], dtype=torch.long))
        finally:
            pipe.free(seq)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


async def local_engine(config) -> LocalEngine:
    """Engine factory for the daemon's ``engine = "meshd.engine:local_engine"`` setting
    (an engine factory is called with the daemon's ``meshd.config.Config``).

    Serves the configured model (``model``; unset = the embedded default) wholly
    on this device — the single-device fallback until the pipeline engine runs.
    """
    from meshd.config import placement_of

    placement = placement_of(config)
    return await LocalEngine.open(getattr(config, "model", None), device=placement.device, dtype=placement.dtype)
