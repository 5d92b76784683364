"""Fixtures the API tests share (the fake engine and its server are in tests/conftest.py)."""

import pytest

from tests.support.api import FakeEngine, ServerThread


@pytest.fixture
def srv():
    """A server on a fresh fake engine (whatever ``engine`` fixture a module defines)."""
    with ServerThread(FakeEngine()) as s:
        yield s
