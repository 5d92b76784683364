"""What both dialects share when they parse a request's options.

The OpenAI parsers (:mod:`meshd.api.openai_schema`) and the Ollama ones
(:mod:`meshd.api.ollama_schema`) both end in one
:class:`meshd.engine.options.RequestOptions`; the helpers here are the parts of
that mapping the two share: meshd's ``speculative`` and ``cloud`` extensions,
grammars checked before use, bounds, and the request's id.
"""

from __future__ import annotations

import uuid
from typing import Any

from decoding.constrained import BadConstraint, validate_spec
from decoding.errors import BadSpeculativeParams
from decoding.speculative.params import SpeculativeParams
from meshd.api.validation import RequestError
from partition.ids import RequestId

MAX_STOP_STRINGS = 4
# Token ids and top_k when the engine does not say its vocabulary size: keeps
# them inside the int32/int64 tensors and message fields they end up in.
MAX_VOCAB = 2**31 - 1


def cloud_choice(value: str | float | None) -> str | float:
    """meshd's ``cloud`` extension as the engine takes it: "auto" when absent, a budget as a float."""
    return "auto" if value is None else (value if isinstance(value, str) else float(value))


def checked_constraint(spec: dict[str, Any], param: str) -> dict[str, Any]:
    try:
        return validate_spec(spec)
    except BadConstraint as exc:
        raise RequestError(str(exc), param=param, code="invalid_schema") from None


def parse_speculative(value: Any, param: str) -> SpeculativeParams:
    """meshd's ``speculative`` extension field ("auto", "off" or an object)."""
    try:
        return SpeculativeParams.parse(value)
    except BadSpeculativeParams as exc:
        raise RequestError(str(exc), param=param, code="invalid_value") from None


def new_id(prefix: str) -> RequestId:
    """A request's id, which its response carries as ``id`` too."""
    return RequestId(f"{prefix}-{uuid.uuid4().hex[:24]}")
