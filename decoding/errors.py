"""Errors of the model runtime, each naming the file and what is wrong.

They all derive from ``DecodingError``; ``decoding`` never imports ``meshd`` (the
layer above lists ``DecodingError`` among its user-facing errors, so the CLI
prints these as one line).
"""


class DecodingError(Exception):
    """Base for every user-facing failure of the model runtime."""


class ModelLoadError(DecodingError):
    """A model file or directory cannot be used (missing, corrupt, unsupported)."""


class UnsupportedArchitecture(ModelLoadError):
    pass


class ContextOverflow(DecodingError):
    """A prompt (plus requested tokens) does not fit the model's context or the cache."""


class CacheError(DecodingError):
    """Misuse of the KV cache: unknown sequence, rollback past a shared prefix, full cache."""


class CacheFull(CacheError):
    """The cache's token budget cannot hold another sequence now (retry later, not a bug)."""


class DrafterError(DecodingError):
    """A drafter cannot be used (heads file missing or corrupt, tokenizer mismatch).

    Speculation is an optimisation: callers that chose a drafter automatically
    fall back to plain decoding with a logged reason; a drafter the client named
    explicitly turns this into a clear 400-style error. It never changes output.
    """


class BadSpeculativeParams(DecodingError):
    """A request's ``speculative`` field is malformed (a 400 for the caller)."""


class DeviceError(DecodingError):
    """A ``--device`` / ``--dtype`` this machine cannot run (no CUDA, an index out of range, a typo)."""
