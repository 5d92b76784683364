"""Fixtures every test folder may use; the helpers behind them are plain modules in tests/support/.

No test module imports another (tests/system/test_suite_rules.py enforces it): what two test
modules share lives here or in tests/support/.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from decoding.memory import release_free_memory
from tests.support.api import FakeEngine, ServerThread
from tests.support.daemons import Mesh
from tests.support.logs import all_log_events
from tests.support.models import build_tiny_checkpoint


# ------------------------------------------------------------------ memory

@pytest.fixture(scope="module", autouse=True)
def _give_freed_memory_back():
    """Each test module gives the heap it freed back to the operating system when it ends.

    A worker runs many modules that load models (float32 Qwen engines, real stages) in
    module-scoped fixtures. Their memory is freed at the module's end, but glibc keeps it in
    its arenas, so a worker's resident size only grows: four workers together came within
    2.5 GB of this 24 GB machine's memory, and once a worker was killed for it.
    """
    yield  # torn down after the module's own fixtures (autouse, so set up first)
    gc.collect()
    release_free_memory()


# ------------------------------------------------------------------ models

@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = build_tiny_checkpoint(path, "llama")
    return path, model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model = build_tiny_checkpoint(path, "qwen2", seed=1, tie_word_embeddings=True)
    return path, model


@pytest.fixture(scope="session")
def real_source():
    """The embedded SmolLM2-135M-Instruct (pulled by the set-up script)."""
    from meshd.model import store as model_store

    if not model_store.is_pulled():
        model_store.pull(quiet=True)
    return model_store.open_model(None)


@pytest.fixture(scope="session")
def real_stage(real_source):
    """The whole embedded model as one stage (loaded once per test session)."""
    return real_source.load_stage(0, real_source.config.num_layers)


@pytest.fixture(scope="session")
def served_stage(real_source):
    """The whole embedded model as one stage in the numeric mode a daemon serves in by default: the
    reference a mesh must equal (``decoding.device.served_reference_stage``)."""
    from decoding.device import served_reference_stage

    return served_reference_stage(real_source)


# ------------------------------------------------------------------ logs

@pytest.fixture
def log_events():
    with all_log_events() as events:
        yield events


# ------------------------------------------------------------------ the API on a fake engine

@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def server(engine):
    with ServerThread(engine) as srv:
        yield srv


@pytest.fixture
def short_tmp():
    """A directory under /tmp: pytest's tmp_path can exceed the 107-byte unix socket limit."""
    d = Path(tempfile.mkdtemp(prefix="meshd-t-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ real daemons

@pytest.fixture
def mesh():
    """Spawns real ``meshd join`` processes; every one is killed and its directory removed after."""
    m = Mesh()
    try:
        yield m
    finally:
        m.cleanup()
