"""Suite-wide fixtures and guards.

- every test ends in the directory it started in (a test, or a library it calls, that changes
  the working directory would break every later test that uses a relative path; the culprit is
  named);
- `tiny`: the seeded random tiny model (`load_model("tiny")`, torch on one thread), one per
  module;
- `master`: a store master on ephemeral ports, closed after the test; a module or test marked
  `@pytest.mark.master(lease_ttl_s=0.2, ...)` gets those `MasterConfig` fields.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tsukimi.engine.weights import LoadedModel
    from tsukimi.store.master.server import MasterServer


@pytest.fixture(autouse=True)
def _same_working_directory(request: pytest.FixtureRequest) -> Iterator[None]:
    before = os.getcwd()
    yield
    after = os.getcwd()
    if after != before:
        os.chdir(before)
        pytest.fail(f"{request.node.nodeid} changed the working directory to {after!r}", pytrace=False)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    import torch

    from tsukimi.engine.weights import load_model

    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.fixture
def master(request: pytest.FixtureRequest) -> Iterator[MasterServer]:
    from tsukimi.config import MasterConfig
    from tsukimi.store.master.server import MasterServer

    marker = request.node.get_closest_marker("master")
    fields = dict(marker.kwargs) if marker is not None else {}
    with MasterServer(MasterConfig(rpc_port=0, http_port=0, **fields)) as server:
        yield server
