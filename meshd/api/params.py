"""What a request asks of its generation besides the prompt, in either dialect.

The OpenAI parsers (:mod:`meshd.api.openai_schema`) and the Ollama ones
(:mod:`meshd.api.ollama_schema`) both end in one :class:`RequestParams`; the
helpers here are the parts of that mapping the two share: meshd's
``speculative`` and ``cloud`` extensions, grammars checked before use, and
the request's id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from decoding.constrained import BadConstraint, validate_spec
from decoding.errors import BadSpeculativeParams
from decoding.sampling import SamplingParams, SamplingSpec
from decoding.speculative.params import SpeculativeParams
from meshd.api.validation import RequestError
from partition.ids import RequestId

MAX_STOP_STRINGS = 4
# Token ids and top_k when the engine does not say its vocabulary size: keeps
# them inside the int32/int64 tensors and message fields they end up in.
MAX_VOCAB = 2**31 - 1


@dataclass
class RequestParams:
    """What a request asks of the generation besides its prompt.

    ``sampling`` is the one :class:`decoding.sampling.SamplingSpec` (the draw,
    penalties, a grammar) that goes on to the engine unchanged; each API makes
    it in one function (``openai_schema._Params.sampling_spec``, ``ollama_schema.sampling_spec``)
    and offered tools may add their grammar. The rest is handled by the API and
    :meth:`meshd.engine.base.Engine.stream`.
    """

    sampling: SamplingSpec = field(default_factory=lambda: SamplingSpec(SamplingParams(temperature=1.0)))
    max_tokens: int | None = None  # None: as many as the context allows
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    constraint_param: str | None = None  # the request field that asked for sampling.constraint, for errors
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)
    outline: str = "auto"  # meshd's extension: outline-based parallel decoding ("auto" | "on" | "off")
    tools_offered: bool = False  # the prompt offers tools (set where tools meet the params)
    cloud: str | float = "auto"  # meshd's extension: a paired cloud verifier ("auto" | "off" | budget 0..1)
    exit_threshold: float | None = None  # meshd's extension: early exits' top-2 margin (None: the daemon's; 0: off)


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
