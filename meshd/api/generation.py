"""From a parsed request to the engine's :class:`~meshd.engine.base.GenerationRequest`.

Both dialects build the prompt (tools through the model's own chat template),
put offered tools under their grammar, and make the engine request here,
which is also where a request that needs an engine capability the engine
lacks gets its 400, instead of being silently served without it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from decoding.loader.chat_template import ChatTemplateError
from decoding.tool_grammar import style_of, tool_spec
from meshd.api.params import checked_constraint
from meshd.api.reasoning import reasoning_start
from meshd.api.validation import RequestError
from meshd.engine.base import Engine, GenerationRequest
from meshd.engine.options import RequestOptions
from meshd.model.store import RECOMMENDED_FOR_HOME_ASSISTANT
from partition.ids import RequestId


def chat_prompt(engine: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                param: str = "tools", **variables: Any) -> list[int]:
    """Token ids of the conversation; tools go through the model's own chat template.

    ``variables`` are the template's switches (Qwen3's ``enable_thinking``). A
    conversation the template refuses (Llama 3.1 takes one call per assistant
    turn) is the client's 400, with the template's reason.
    """
    if tools and not getattr(engine.tokenizer, "supports_tools", False):
        raise RequestError(
            f"tools are not supported by model '{engine.model_id}': its chat template has no tool support "
            f"(send the request without '{param}', or serve a tool-capable model such as "
            f"{RECOMMENDED_FOR_HOME_ASSISTANT})", param=param, code="tools_not_supported")
    extra = {"tools": tools} if tools else {}
    try:
        return list(engine.tokenizer.apply_chat(messages, **extra, **variables))
    except ChatTemplateError as exc:
        raise RequestError(str(exc), param="messages", code="invalid_value") from None


def constrain_tool_calls(engine: Engine, options: RequestOptions, tools: list[dict[str, Any]],
                         choice: str | None = None, parallel: bool = True,
                         prompt_ids: list[int] | None = None) -> RequestOptions:
    """``options`` with offered tools' grammar (``decoding.tool_grammar``) over the answer.

    The model still answers in words when it wants to; a call it starts is
    written under the tools' grammar, so it always parses, names an offered
    tool and has arguments valid against that tool's schema. ``choice``
    "required" or a tool name constrains from the first token. A
    ``response_format`` already constrains the whole answer (and a forced
    choice with one was refused when parsing), so it is left as it is.
    ``tools_offered`` records that calls may come (outline mode stays away).
    A thinking model's think block (``prompt_ids`` say whether the prompt
    opened it) is left free: the grammar starts after it.
    """
    options = replace(options, tools_offered=bool(tools) and choice != "none")
    if not tools or choice == "none" or options.sampling.constraint is not None:
        return options
    forced = choice is not None
    if not forced and not engine.capabilities.constraints:
        return options  # calls are parsed from free text (generation_request refuses the forced case)
    meta = getattr(getattr(engine, "tokenizer", None), "meta", None)
    reasoning = reasoning_start(engine.tokenizer, prompt_ids)
    spec = tool_spec(tools, style_of(getattr(meta, "chat_template", None)), required=choice == "required",
                     parallel=parallel, only=choice if forced and choice != "required" else None,
                     reasoning=reasoning)
    return replace(options, sampling=options.sampling.with_constraint(checked_constraint(spec, "tools")),
                   constraint_param="tool_choice" if forced else "tools")


def generation_request(engine: Engine, rid: RequestId, prompt_ids: list[int], options: RequestOptions,
                       messages: list[dict] | None, *, context_limit: int | None = None,
                       penalty_param: str = "presence_penalty") -> GenerationRequest:
    """The engine request, or a 400 when it needs something the engine cannot do.

    ``context_limit`` (Ollama's ``num_ctx``) narrows the engine's context for
    this request. Which modes combine is the engine's to decide (``meshd.engine.modes``).
    """
    can = engine.capabilities
    if options.sampling.constraint is not None and not can.constraints:
        raise RequestError("structured output is not supported by this engine (yet): it cannot "
                           "constrain the tokens it samples", param=options.constraint_param,
                           code="unsupported_parameter")
    if options.sampling.penalties.active and not can.penalties:
        raise RequestError("repetition penalties are not supported by this engine (yet); send "
                           "them at their defaults", param=penalty_param, code="unsupported_parameter")
    if options.outline == "on" and not can.outline:
        raise RequestError("outline decoding needs the mesh's pipeline engine; send outline \"auto\" or "
                           "\"off\"", param="outline", code="unsupported_parameter")
    if options.outline == "on" and not messages:
        raise RequestError("outline decoding needs a chat request (it asks the model for an outline of "
                           "its answer)", param="outline", code="unsupported_parameter")
    if options.cloud not in ("auto", "off") and not can.cloud:
        raise RequestError("cloud verification needs the mesh's pipeline engine paired with a verifier; "
                           "send cloud \"auto\" or \"off\"", param="cloud", code="unsupported_parameter")
    if options.exit_threshold and not can.exits:
        raise RequestError("early exits need the mesh's pipeline engine; send exit_threshold 0 or leave it out",
                           param="exit_threshold", code="unsupported_parameter")
    engine.check_prompt(prompt_ids)
    ctx = engine.context_length if context_limit is None else min(engine.context_length, context_limit)
    room = ctx - len(prompt_ids)
    if room < 1:
        raise RequestError(f"the prompt is {len(prompt_ids)} tokens; the context for this request "
                           f"is {ctx}", status=400, param="messages", code="context_length_exceeded")
    return GenerationRequest(request_id=rid, prompt_ids=prompt_ids, max_tokens=min(options.max_tokens or room, room),
                             messages=messages, options=options)
