"""What an engine answers when a generation cannot be served, in the API's vocabulary.

Each error names the HTTP status, the OpenAI error type and code the API answers
with, and whether (and when) retrying helps, so every engine fails the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshd.errors import MeshdError

__all__ = ["BadEngineRequest", "BadTokenIds", "EngineBusy", "EngineError", "EngineUnavailable", "GenerationFailed",
           "NoPlan", "PromptTooLong", "WrongModel", "out_of_vocab"]

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
