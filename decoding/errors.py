"""Errors of the model runtime, each naming the file and what is wrong."""

from meshd.errors import MeshdError


class ModelLoadError(MeshdError):
    """A model file or directory cannot be used (missing, corrupt, unsupported)."""


class UnsupportedArchitecture(ModelLoadError):
    pass


class ContextOverflow(MeshdError):
    """A prompt (plus requested tokens) does not fit the model's context or the cache."""


class CacheError(MeshdError):
    """Misuse of the KV cache: unknown sequence, rollback past a shared prefix, full cache."""
