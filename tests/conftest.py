"""Suite-wide guards: every test ends in the directory it started in (a test, or a library it
calls, that changes the working directory would break every later test that uses a relative
path; the culprit is named)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _same_working_directory(request: pytest.FixtureRequest) -> Iterator[None]:
    before = os.getcwd()
    yield
    after = os.getcwd()
    if after != before:
        os.chdir(before)
        pytest.fail(f"{request.node.nodeid} changed the working directory to {after!r}", pytrace=False)
