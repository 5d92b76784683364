"""The Ollama API, so Home Assistant's Ollama integration (and any Ollama client) can use meshd.

Routes: ``/api/version``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/chat`` and ``/api/generate`` (NDJSON streaming by default, as
Ollama), ``/api/pull``, and ``GET /`` ("Ollama is running"). Errors are
Ollama's ``{"error": "..."}`` (the server's middleware picks the dialect by
path). A model name the home does not serve (nor alias) is Ollama's 404
``model "X" not found, try pulling it first`` (:mod:`meshd.api.names`).

This module serves the two generation routes; the bodies and what their
fields mean are in :mod:`meshd.api.ollama_schema`, the model endpoints in
:mod:`meshd.api.ollama_models`.
"""

from __future__ import annotations

import contextlib
import time

from aiohttp import web

from meshd.api import ollama_models as models
from meshd.api import ollama_replies as replies
from meshd.api import tools as tl
from meshd.api.answer import Answer, tracked
from meshd.api.common import await_engine, log, read_json, served_model, vocab_size
from meshd.api.generation import chat_prompt, constrain_tool_calls, generation_request
from meshd.api.names import tagged as _tagged
from meshd.api.ollama_schema import ChatBody, GenerateBody, GenerationBody, history, request_options
from meshd.api.params import MAX_VOCAB, new_id
from meshd.api.reasoning import splitter_for, thinks
from meshd.api.validation import RequestError, validate
from meshd.engine.base import Engine
from meshd.engine.errors import EngineError
from meshd.engine.options import RequestOptions


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", models.root)  # also answers HEAD
    app.router.add_get("/api/version", models.version)
    app.router.add_get("/api/tags", models.tags)
    app.router.add_post("/api/show", models.show)
    app.router.add_get("/api/ps", models.ps)
    app.router.add_post("/api/chat", _chat)
    app.router.add_post("/api/generate", _generate)
    app.router.add_post("/api/pull", models.pull)
    for path in ("/api/embed", "/api/embeddings", "/api/create", "/api/copy", "/api/push"):
        app.router.add_post(path, models.not_implemented)
    app.router.add_delete("/api/delete", models.not_implemented)


async def _chat(request: web.Request) -> web.StreamResponse:
    body = validate(ChatBody, await read_json(request))
    engine = await await_engine(request)
    served_model(request, engine, body.model, ollama=True)
    options, num_ctx = request_options(body, vocab_size(engine))
    if not body.messages:  # Ollama: an empty chat loads the model and answers at once
        return web.json_response(replies.loaded(body.model or _tagged(engine.model_id), "chat"))
    try:
        tools = tl.parse_tools(body.tools)
    except tl.ToolError as exc:
        raise exc.as_request_error() from None
    messages = history(body.messages)
    prompt_ids = chat_prompt(engine, messages, tools, **_thinking(engine, body))
    options = constrain_tool_calls(engine, options, tools, prompt_ids=prompt_ids)
    return await _run(request, engine, body, options, num_ctx, prompt_ids, messages,
                      tl.tool_names(tools), "chat")


async def _generate(request: web.Request) -> web.StreamResponse:
    body = validate(GenerateBody, await read_json(request))
    engine = await await_engine(request)
    served_model(request, engine, body.model, ollama=True)
    options, num_ctx = request_options(body, vocab_size(engine))
    if not body.prompt and not body.context:
        return web.json_response(replies.loaded(body.model or _tagged(engine.model_id), "generate"))
    vocab = vocab_size(engine) or MAX_VOCAB
    context = list(body.context or [])
    bad = next((t for t in context if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"'context' holds token id {bad}, outside the vocabulary [0, {vocab})",
                           param="context", code="invalid_value")
    if body.raw:
        prompt_ids = context + list(engine.tokenizer.encode(body.prompt))
        messages = None
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        prompt_ids = context + chat_prompt(engine, messages, [], **_thinking(engine, body))
    return await _run(request, engine, body, options, num_ctx, prompt_ids, messages, [], "generate")


async def _run(request: web.Request, engine: Engine, body: GenerationBody, options: RequestOptions,
               num_ctx: int | None, prompt_ids: list[int], messages, offered: list[str],
               kind: str) -> web.StreamResponse:
    started_ns = time.monotonic_ns()
    rid = new_id("ollama")
    gen = generation_request(engine, rid, prompt_ids, options, messages, context_limit=num_ctx,
                             penalty_param="options.repeat_penalty")
    model = body.model or _tagged(engine.model_id)
    reasoning = splitter_for(engine.tokenizer, prompt_ids) if messages is not None else None
    async with tracked(request, engine, gen, "ollama", f"/api/{kind}") as (events, run):
        # errors before the first token keep their HTTP status
        answer = await Answer.begin(events, run, offered, reasoning)
        resp: web.StreamResponse | None = None
        if body.stream:
            resp = web.StreamResponse(headers={"Content-Type": replies.NDJSON, "X-Request-Id": rid})
            await resp.prepare(request)
        parts: list[str] = []
        thoughts: list[str] = []
        try:
            async with contextlib.aclosing(answer.pieces()) as pieces:
                async for piece in pieces:
                    if resp is not None:
                        await resp.write(replies.line(replies.part(kind, model, piece.content, piece.reasoning)))
                    else:
                        parts.append(piece.content)
                        thoughts.append(piece.reasoning)
            if answer.final is not None and resp is None:
                final = replies.final(request, kind, model, answer.final, run, started_ns, prompt_ids,
                                      answer.token_ids)
                return web.json_response(_whole(final, kind, "".join(parts), answer.calls, "".join(thoughts)))
            if answer.final is not None:
                if answer.calls:
                    msg = replies.part(kind, model, "")
                    msg["message"]["tool_calls"] = [c.ollama() for c in answer.calls]
                    await resp.write(replies.line(msg))
                await resp.write(replies.line(replies.final(request, kind, model, answer.final, run, started_ns,
                                                            prompt_ids, answer.token_ids)))
                await resp.write_eof()
                return resp
        except ConnectionResetError:
            run.hung_up()
            return resp or web.Response(status=499)
        except EngineError as exc:
            if resp is None:
                raise
            run.ok = False  # headers are gone: Ollama reports a failure in-band
            log.warning("api_request_failed_in_stream", path=request.path, error=str(exc))
            with contextlib.suppress(ConnectionResetError):
                await resp.write(replies.line({"error": str(exc)}))
                await resp.write_eof()
            return resp
        raise EngineError("the engine ended without a final event")


def _whole(final: dict, kind: str, content: str, calls: list[tl.ToolCall], thinking: str) -> dict:
    """The final message of an answer that was not streamed: it carries the whole answer."""
    if kind == "chat":
        final["message"] = {"role": "assistant", "content": content}
        if thinking:
            final["message"]["thinking"] = thinking
        if calls:
            final["message"]["tool_calls"] = [c.ollama() for c in calls]
    else:
        final["response"] = content
        if thinking:
            final["thinking"] = thinking
    return final


def _thinking(engine: Engine, body: GenerationBody) -> dict[str, bool]:
    """Ollama's ``think`` as the template's ``enable_thinking`` (absent: the template's default).

    Ollama refuses ``think`` for a model that does not think, and its levels
    ("high", ...) exist only for gpt-oss; both are a 400 here too.
    """
    if body.think is None:
        return {}
    if isinstance(body.think, str):
        raise RequestError(f"'think' must be true or false for model '{engine.model_id}' (levels such as "
                           f"{body.think!r} are only for gpt-oss)", param="think", code="invalid_value")
    if body.think and not thinks(engine.tokenizer):
        raise RequestError(f'"{engine.model_id}" does not support thinking', param="think",
                           code="invalid_value")
    return {"enable_thinking": body.think} if thinks(engine.tokenizer) else {}
