"""The OpenAI routes: chat and text completions, and the model list.

A handler validates the body (:mod:`meshd.api.openai_schema`), builds the
prompt and the engine request (:mod:`meshd.api.generation`), and answers with
one JSON object or, streaming, with server-sent events
(:mod:`meshd.api.openai_replies`). Once the headers are gone a failure is
reported in-band, as OpenAI does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from meshd.api import openai_replies as replies
from meshd.api import tools as tl
from meshd.api.answer import Answer, tracked
from meshd.api.common import ENGINE, NAMES, await_engine, log, read_json, served_model, vocab_size
from meshd.api.errors import from_engine_error, internal_error, log_rejected
from meshd.api.generation import chat_prompt, constrain_tool_calls, generation_request
from meshd.api.names import not_found
from meshd.api.openai_schema import parse_chat_request, parse_completion_request
from meshd.api.params import new_id
from meshd.api.reasoning import ReasoningSplitter, Split, splitter_for
from meshd.api.usage import public_usage
from meshd.api.validation import RequestError
from meshd.engine.base import Engine, TokenEvent
from meshd.engine.errors import EngineError
from meshd.engine.options import RequestOptions


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id}", _model)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    engine = await await_engine(request)
    req = parse_chat_request(body, vocab_size=vocab_size(engine))
    served_model(request, engine, req.model, ollama=False)
    prompt_ids = chat_prompt(engine, req.messages, req.tools, **req.template_variables)
    options = constrain_tool_calls(engine, req.options, req.tools, req.tool_choice, req.parallel_tool_calls,
                                   prompt_ids=prompt_ids)
    return await _serve(request, engine, "chat", prompt_ids, options, req.messages,
                        tl.tool_names(req.tools), req.parallel_tool_calls,
                        splitter_for(engine.tokenizer, prompt_ids))


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    engine = await await_engine(request)
    req = parse_completion_request(body, vocab_size=vocab_size(engine))
    served_model(request, engine, req.model, ollama=False)
    if isinstance(req.prompt, str):
        prompt_ids = list(engine.tokenizer.encode(req.prompt))
    else:
        prompt_ids = req.prompt  # checked against the vocabulary by the schema
    if not prompt_ids:
        raise RequestError("'prompt' is empty", param="prompt", code="invalid_value")
    return await _serve(request, engine, "text", prompt_ids, req.options, None, [], True)


async def _models(request: web.Request) -> web.Response:
    """The served model, then each configured alias (clients pick from this list)."""
    engine = request.app[ENGINE]
    return web.json_response(replies.models_list(request.app[NAMES].listed(engine.model_id) if engine else []))


async def _model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    asked = request.match_info["model_id"]
    if engine is None:
        raise RequestError("no model is loaded yet", status=404, type="not_found_error",
                           param="model", code="model_not_found")
    if not asked.strip() or not request.app[NAMES].known(engine.model_id, asked):
        raise not_found(asked, engine.model_id, ollama=False)
    return web.json_response(replies.model_object(asked if request.app[NAMES].is_alias(engine.model_id, asked)
                                                  else engine.model_id))


async def _serve(
    request: web.Request, engine: Engine, kind: str, prompt_ids: list[int],
    options: RequestOptions, messages: list[dict] | None, offered: list[str], parallel: bool,
    reasoning: ReasoningSplitter | None = None,
) -> web.StreamResponse:
    """``reasoning``: a thinking model's splitter (its think block goes to ``reasoning_content``)."""
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    gen = generation_request(engine, rid, prompt_ids, options, messages)
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with tracked(request, engine, gen, "openai", endpoint) as (events, run):
        if options.stream:
            return await _stream(request, engine, kind, rid, options, events, run, offered, parallel, reasoning)
        return await _collect(request, engine, kind, rid, events, run, offered, parallel, reasoning)


def _calls(text: str, offered: list[str], parallel: bool) -> tuple[str, list[tl.ToolCall]]:
    content, calls = tl.parse_tool_calls(text, offered)
    return content, (calls if parallel else calls[:1])


async def _collect(request: web.Request, engine: Engine, kind: str, rid: str, events, run, offered: list[str],
                   parallel: bool, reasoning: ReasoningSplitter | None) -> web.Response:
    parts: list[str] = []
    last: TokenEvent | None = None
    async for ev in events:
        run.saw(ev)
        parts.append(ev.text)
        last = ev
    if last is None or last.usage is None:
        raise EngineError("the engine ended without a final event")
    text, usage, created = "".join(parts), public_usage(request, last.usage), replies.now()
    if kind == "chat":
        split = Split(content=text) if reasoning is None else reasoning.feed(text) + reasoning.finish()
        content, calls = _calls(split.content, offered, parallel)
        finish = "tool_calls" if calls else last.finish_reason
        body = replies.chat_response(rid, created, engine.model_id, content if calls else split.content, finish,
                                     usage, [c.openai() for c in calls] or None, reasoning=split.reasoning)
    else:
        body = replies.completion_response(rid, created, engine.model_id, text, last.finish_reason, usage)
    return web.json_response(body)



async def _stream(
    request: web.Request, engine: Engine, kind: str, rid: str,
    options: RequestOptions, events, run, offered: list[str], parallel: bool,
    reasoning: ReasoningSplitter | None,
) -> web.StreamResponse:
    answer = await Answer.begin(events, run, offered, reasoning)
    frames = _Frames(kind, rid, replies.now(), engine.model_id)
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid,
    })
    await resp.prepare(request)
    try:
        if kind == "chat":
            await resp.write(frames.role())
        async with contextlib.aclosing(answer.pieces()) as pieces:
            async for piece in pieces:
                if piece.reasoning:
                    await resp.write(frames.reasoning(piece.reasoning))
                if piece.content:
                    await resp.write(frames.text(piece.content))
        if answer.final is not None:
            finish = answer.final.finish_reason
            calls = answer.calls if parallel else answer.calls[:1]
            if calls:
                finish = "tool_calls"
                await resp.write(frames.tool_calls(calls))
            await resp.write(frames.text(finish=finish))
            if options.include_usage and answer.final.usage is not None:
                await resp.write(frames.usage(public_usage(request, answer.final.usage)))
            await resp.write(replies.SSE_DONE)
    except ConnectionResetError:
        run.hung_up()
        return resp
    except EngineError as exc:
        # Headers are gone; tell the client in-band the way OpenAI does.
        run.ok = False
        err = from_engine_error(exc)
        log_rejected(err, request.path, in_stream=True)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(replies.sse(err.body()))
    except Exception:  # noqa: BLE001 - same in-band answer, details only in our log
        run.ok = False
        log.exception("api_internal_error", path=request.path, in_stream=True)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(replies.sse(internal_error().body()))
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


@dataclass(frozen=True)
class _Frames:
    """The server-sent events of one streamed reply: chat chunks, or text completions."""

    kind: str
    rid: str
    created: int
    model: str

    def role(self) -> bytes:
        return replies.sse(replies.chat_chunk(self.rid, self.created, self.model,
                                              delta={"role": "assistant", "content": ""}))

    def text(self, text: str = "", finish: str | None = None) -> bytes:
        if self.kind == "chat":
            return replies.sse(replies.chat_chunk(self.rid, self.created, self.model,
                                                  delta={"content": text} if text else {}, finish=finish))
        return replies.sse(replies.completion_response(self.rid, self.created, self.model, text, finish))

    def reasoning(self, text: str) -> bytes:
        """A piece of a thinking model's think block (chat only: a raw completion is not split)."""
        return replies.sse(replies.chat_chunk(self.rid, self.created, self.model,
                                              delta={"reasoning_content": text}))

    def tool_calls(self, calls: list[tl.ToolCall]) -> bytes:
        return replies.sse(replies.chat_chunk(self.rid, self.created, self.model, delta={
            "tool_calls": [c.openai(index=i) for i, c in enumerate(calls)]}))

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The trailing chunk with no choices that ``stream_options.include_usage`` asks for."""
        if self.kind == "chat":
            tail = replies.chat_chunk(self.rid, self.created, self.model, usage=usage, no_choices=True)
        else:
            tail = replies.completion_response(self.rid, self.created, self.model, "", None, usage,
                                               no_choices=True)
        return replies.sse(tail)
