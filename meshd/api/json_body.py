"""A request body from raw bytes to a JSON object, with hostile input bounded first.

UTF-8, nesting depth, integer length and lone surrogates are checked before
any field is looked at: hostile JSON must become a 400, never a 500 from deep
inside a handler. Both dialects read their bodies through here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from meshd.api.validation import RequestError, json_type

MAX_JSON_DEPTH = 64
# Longer integer literals are never a meaningful value here, and Python's own
# int-from-string limit would otherwise surface as a 500.
MAX_INT_DIGITS = 100
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_body(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """Decode a request body; the top level must be a JSON object.

    Strict UTF-8 (``json.loads`` on bytes would let UTF-8-encoded surrogates
    through), bounded nesting and integer length, and no lone ``\\uD800``
    escapes, which would fail later when the text is encoded or tokenised.
    """
    if not raw.strip():
        raise RequestError("request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _json_error(f"is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_int=_parse_int, parse_constant=_reject_constant)
    except RecursionError:
        raise _json_error(f"nests deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, and the hooks' own errors
        raise _json_error(f"is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(
            f"request body must be a JSON object, got {json_type(body)}", code="invalid_json"
        )
    _check_structure(body, text, max_depth)
    return body


def _json_error(what: str) -> RequestError:
    return RequestError(f"request body {what}", code="invalid_json")


def _parse_int(s: str) -> int:
    if len(s) - s.startswith("-") > MAX_INT_DIGITS:
        raise ValueError(f"an integer literal has {len(s)} digits (at most {MAX_INT_DIGITS})")
    return int(s)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_structure(body: dict[str, Any], text: str, max_depth: int) -> None:
    """Reject bodies nested deeper than ``max_depth`` or holding lone surrogates.

    Both walks are skipped when the raw text proves them unnecessary (few
    brackets, no ``\\u`` escape), so ordinary requests pay nothing.
    """
    deep = text.count("[") + text.count("{") > max_depth
    escapes = "\\u" in text
    if not (deep or escapes):
        return
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, (dict, list)) and depth > max_depth:
            raise RequestError(f"request body nests deeper than {max_depth} levels",
                               param=path or None, code="invalid_json")
        if isinstance(node, dict):
            for k, v in node.items():
                where = f"{path}.{k}" if path else str(k)
                if escapes and _SURROGATE.search(k):
                    raise _surrogate_error(path or None)
                stack.append((v, depth + 1, where))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))
        elif escapes and isinstance(node, str) and _SURROGATE.search(node):
            raise _surrogate_error(path)


def _surrogate_error(param: str | None) -> RequestError:
    return RequestError("a string holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                        "valid Unicode text", param=param, code="invalid_json")
