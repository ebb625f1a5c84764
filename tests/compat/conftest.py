"""Fixtures shared by the facade's tests: one in-process tsukimi master per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tsukimi.config import MasterConfig
from tsukimi.store.master.server import MasterServer


@pytest.fixture(scope="module")
def module_master() -> Iterator[MasterServer]:
    """A master for the whole module (short read leases, so removes after gets wait little)."""
    with MasterServer(MasterConfig(rpc_port=0, http_port=0, lease_ttl_s=0.2)) as server:
        yield server
