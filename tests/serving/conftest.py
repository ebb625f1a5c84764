"""Fixtures shared by tests/serving (the fakes themselves: fakes.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serving.fakes import FakeWorker, close_all


@pytest.fixture
def workers() -> Iterator[list[FakeWorker]]:
    """Append FakeWorkers; they are closed (in parallel) after the test."""
    made: list[FakeWorker] = []
    yield made
    close_all([worker.close for worker in made])
