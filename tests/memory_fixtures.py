"""Each test module gives the heap it freed back to the operating system when it ends.

A worker runs many modules that load models (float32 Qwen engines, real stages) in
module-scoped fixtures. Their memory is freed at the module's end, but glibc keeps it in
its arenas, so a worker's resident size only grows: four workers together came within
2.5 GB of this 24 GB machine's memory, and once a worker was killed for it.
"""

from __future__ import annotations

import gc

import pytest

from decoding.memory import release_free_memory


@pytest.fixture(scope="module", autouse=True)
def _give_freed_memory_back():
    yield  # torn down after the module's own fixtures (autouse, so set up first)
    gc.collect()
    release_free_memory()
