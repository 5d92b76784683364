"""Request errors, and pydantic validation that produces them (shared by the OpenAI and Ollama APIs).

Every rejected request is a :class:`RequestError`: an HTTP status and an
OpenAI-style error object whose ``param`` names the offending field with the
path a client author would write (``messages[0].content[1].text``,
``options.top_p``). Request bodies are validated by pydantic models;
:func:`validate` turns the first ``ValidationError`` into that 400, phrased
like the rest of the API ("'temperature' must be a number between 0 and 2
(got 3)").

Models shape their messages with two helpers: :func:`described` collapses
whatever pydantic says about a field (wrong type, out of range) into one
"must be ..." sentence, and :func:`invalid` raises a message (and error
``code``) of the validator's own.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

ERROR_TYPE = "meshd"  # the pydantic error type of messages written by our validators


class RequestError(Exception):
    """A request the API answers with an OpenAI-style error object.

    ``retry_after_s`` becomes a ``Retry-After`` header (busy / no plan yet).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` exactly as OpenAI returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------- validators' helpers


def invalid(what: str, code: str = "invalid_value", *, show_value: bool = True,
            whole: bool = False) -> PydanticCustomError:
    """An error to raise from a validator: the client reads "'<field>' <what> (got <value>)".

    ``show_value=False`` leaves out "(got ...)" (when ``what`` already names the value);
    ``whole=True`` sends ``what`` alone (a complete message, e.g. from a parser of its own).
    """
    # The text travels in the context, read back verbatim by request_error: as the template,
    # pydantic would fill in "{code}" even where it came from the client's own value.
    return PydanticCustomError(ERROR_TYPE, "{what}", {"what": what, "code": code,
                                                      "show_value": show_value and not whole, "whole": whole})


def described(what: str, code: str = "invalid_value") -> WrapValidator:
    """Annotated metadata: any error of the annotated value reads "'<field>' must be <what>"."""

    def wrap(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise invalid(f"must be {what}", code) from None

    return WrapValidator(wrap)


# --------------------------------------------------------------------------- validation


def validate(model: type[BaseModel], body: Any, *, context: dict[str, Any] | None = None):
    """``model.model_validate(body)``; a ``ValidationError`` becomes a 400 :class:`RequestError`."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise request_error(exc) from None


def request_error(exc: ValidationError) -> RequestError:
    """The first error of ``exc`` as the API's 400, ``param`` = the field's path."""
    err = exc.errors(include_url=False)[0]
    param = param_of(err["loc"])
    ctx = err.get("ctx") or {}
    kind = err["type"]
    code = "invalid_value"
    show_value = kind != "missing"
    if kind == ERROR_TYPE:
        what, code, show_value = ctx.get("what", err["msg"]), ctx.get("code", code), ctx.get("show_value", True)
    else:
        what = _phrase(kind, ctx, err["msg"])
    message = f"'{param}' {what}" if param and not ctx.get("whole") else what
    if show_value:
        message += f" (got {shown(err.get('input'))})"
    return RequestError(message, param=param, code=code)


def param_of(loc: tuple[Any, ...]) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


_TYPES = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "a boolean", "bool_parsing": "a boolean", "string_type": "a string",
    "list_type": "an array", "dict_type": "an object", "model_type": "an object",
    "model_attributes_type": "an object",
}
_BOUNDS = {"greater_than_equal": ("at least", "ge"), "greater_than": ("greater than", "gt"),
           "less_than_equal": ("at most", "le"), "less_than": ("less than", "lt")}


def _phrase(kind: str, ctx: dict[str, Any], msg: str) -> str:
    """pydantic's error, said the way the rest of the API says it."""
    if kind in _TYPES:
        return f"must be {_TYPES[kind]}"
    if kind in _BOUNDS:
        word, key = _BOUNDS[kind]
        bound = ctx.get(key)
        return f"must be {word} {bound:g}" if isinstance(bound, float) else f"must be {word} {bound}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a field meshd knows (an unknown option would be silently ignored)"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind == "too_short":
        n = ctx.get("min_length")
        return "must not be empty" if n == 1 else f"must hold at least {n} items"
    if kind == "too_long":
        return f"accepts at most {ctx.get('max_length')} items"
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    return msg.removeprefix("Value error, ")


# --------------------------------------------------------------------------- showing values


def json_type(v: Any) -> str:
    return {
        dict: "an object", list: "an array", str: "a string", bool: "a boolean",
        int: "a number", float: "a number", type(None): "null",
    }.get(type(v), type(v).__name__)


def shown(value: Any) -> str:
    """A short rendering of a client's value for an error message (never the whole body)."""
    if value is None:
        return "missing or null"
    if isinstance(value, (dict, list)) and len(value) > 8:
        return f"{json_type(value)} of {len(value)} items"
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return type(value).__name__
