"""The whole model on this device: the engine a daemon serves before (or without) a mesh.

torch work runs in a worker thread (:func:`iterate_in_thread`), so the event loop
keeps serving status and other clients while a generation computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from meshd.engine.base import Budget, Engine, GenerationRequest, model_id_of
from meshd.engine.errors import EngineError, GenerationFailed, PromptTooLong
from meshd.engine.options import Capabilities
from meshd.errors import USER_ERRORS
from meshd.log import get_logger

log = get_logger("meshd.engine.base")

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


class LocalEngine(Engine):
    """The whole model on this device, using the reference runtime in ``decoding``.

    torch work runs in one dedicated worker thread (so the event loop keeps
    serving status and other clients) and tokens come back through an asyncio
    queue. One generation runs at a time; later requests wait their turn on a
    lock, in arrival order. Constructing it loads the weights (blocking; use
    :meth:`open` from async code).
    """

    def __init__(self, source, *, dtype=None, max_context: int | None = None, stages: int = 1, device=None):
        """``device``: where the model runs (default the CPU); ``dtype`` None: that device's default."""
        import concurrent.futures

        from decoding.memory import freeze_long_lived
        from decoding.pipeline_local import LocalPipeline

        self.source = source
        self.tokenizer = source.tokenizer
        self.model_id = model_id_of(source)
        self.vocab_size = source.config.vocab_size
        ctx = source.config.max_position
        self.context_length = min(ctx, max_context) if max_context else ctx
        self._pipeline = LocalPipeline.from_source(source, stages, dtype, device)
        freeze_long_lived()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshd-generate")
        self._lock = asyncio.Lock()

    @property
    def capabilities(self) -> Capabilities:
        """Penalties, and grammars where the model has a tokenizer.json (the grammar library reads its
        vocabulary there)."""
        return Capabilities(constraints=getattr(self.tokenizer, "path", None) is not None, penalties=True)

    @classmethod
    async def open(cls, path=None, **kw) -> LocalEngine:
        """Open ``path`` (None: the embedded default model) and load it off the event loop."""
        from meshd.model.store import open_model

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
        budget = Budget(req.max_tokens, eos)
        select = TokenSelector.for_spec(req.options.sampling, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                        prompt_tail=req.prompt_ids)
        pipe, seq = self._pipeline, req.request_id
        pipe.create(seq, len(req.prompt_ids) + req.max_tokens)
        try:
            with torch.inference_mode():
                logits = pipe.prefill(seq, list(req.prompt_ids))
                for i in range(req.max_tokens):
                    tok = select(logits[-1])
                    yield tok
                    if budget.finish(tok, i + 1) or cancel.is_set():
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
    """Engine factory for the daemon's ``engine = "meshd.engine.local:local_engine"`` setting
    (an engine factory is called with the daemon's ``meshd.config.Config``).

    Serves the configured model (``model``; unset = the embedded default) wholly
    on this device — the single-device fallback until the pipeline engine runs.
    """
    from meshd.config import placement_of

    placement = placement_of(config)
    return await LocalEngine.open(getattr(config, "model", None), device=placement.device, dtype=placement.dtype)
