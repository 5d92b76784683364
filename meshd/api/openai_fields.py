"""The OpenAI request fields' types and rules, shared by the chat and completion bodies.

Strict (no "10" for 10, no true for 1): an OpenAI client sends JSON types,
and anything else is a client bug worth a 400. A field meshd does not
implement is declared with :func:`only_default`: accepted at its default
value, refused as "not supported" otherwise, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo

from meshd.api.params import MAX_STOP_STRINGS, MAX_VOCAB
from meshd.api.validation import described, invalid

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's seed range; torch and msgpack take it


def vocab_bound(info: ValidationInfo) -> int:
    return (info.context or {}).get("vocab") or MAX_VOCAB


def _only_one(v: int) -> int:
    if v != 1:
        raise invalid("only 1 is supported")
    return v


def _stop_list(stop: str | list[str]) -> list[str]:
    if isinstance(stop, str):
        return [stop]
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"accepts at most {MAX_STOP_STRINGS} strings")
    return stop


def only_default(*defaults: Any) -> AfterValidator:
    """A field meshd does not implement: accepted at one of ``defaults``, else a 400 "not supported"."""

    def check(v: Any) -> Any:
        if not _is_default(v, defaults):
            raise invalid("is not supported by meshd (only its default is accepted)",
                          "unsupported_parameter")
        return v

    return AfterValidator(check)


def _is_default(v: Any, defaults: tuple) -> bool:
    """``v == d`` without Python's ``True == 1`` / ``0 == False`` leniency (numbers still match)."""
    for d in defaults:
        if _is_number(v) and _is_number(d):
            if v == d:
                return True
        elif type(v) is type(d) and v == d:
            return True
    return False


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


Temperature = Annotated[float, Field(ge=0.0, le=2.0), described("a number between 0 and 2")]
TopP = Annotated[float, Field(gt=0.0, le=1.0), described("a number greater than 0 and at most 1")]
# meshd's extension: whether a paired cloud verifier checks the answer ("auto", "off") or at which budget.
Cloud = Annotated[Literal["auto", "off"] | Annotated[float, Field(ge=0.0, le=1.0, strict=True)],
                  described('"auto", "off" or a cloud budget from 0 to 1')]
# meshd's extension: early exits (Synera) leave the model where the top-2 margin clears this (0: off).
ExitThreshold = Annotated[float, Field(ge=0.0, le=1.0, strict=True), described("a number from 0 (off) to 1")]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0), described("a number between -2 and 2")]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX),
                 described(f"an integer from {INT64_MIN} to {INT64_MAX} (a signed 64-bit integer)")]
MaxTokens = Annotated[int, Field(ge=1), described("an integer >= 1")]  # the server clips it to the context
OneChoice = Annotated[int, Field(ge=1, le=128), described("an integer from 1 to 128 (OpenAI's range)"),
                      AfterValidator(_only_one)]
Stop = Annotated[str | list[str], described("a string or an array of strings"), AfterValidator(_stop_list)]
STRICT = ConfigDict(strict=True, extra="ignore")
