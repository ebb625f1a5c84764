"""The connection of a `MooncakeDistributedStore` to the store: the `StoreClient` its `setup`
(or `setup_dummy`) made, the segment name `get_hostname()` reports, and the finalizer that
closes the client when nobody holds the store any more.

Every part of the facade (objects.py, replicas.py, ranges.py, multi_buffers.py, tensors.py,
tensor_parallel.py) is given the store's one `StoreConnection` and asks it for the client per
call: `ready()` answers None (and logs, as Mooncake does) before setup and after close, and each
part turns that into its own "not set up" answer (RPC_FAIL, None, [] ...).
"""

from __future__ import annotations

import logging
import weakref

from tsukimi.compat.mooncake import setup_args
from tsukimi.store.client import StoreClient
from tsukimi.transfer import TransferEngine

logger = logging.getLogger(__name__)


class StoreConnection:
    """The client of one facade store, or none (before setup, after close)."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._hostname = ""
        self._finalizer: weakref.finalize[[], StoreConnection] | None = None

    def open(
        self, setup: setup_args.StoreSetup, engine: TransferEngine | None, holds_segment: bool = True
    ) -> StoreClient:
        """Connect as `setup` says (`engine`: a Transfer Engine to share). Mutates: the new
        client replaces none (close the previous one first). `holds_segment` False (a dummy
        client) leaves the hostname "", as in Mooncake.

        Raises:
            What `setup_args.connect` raises (TsukimiError, OSError); nothing is kept then.
        """
        assert self._client is None, "close the previous client first"
        client = setup_args.connect(setup, engine)
        self._client, self._hostname = client, client.engine.name if holds_segment else ""
        # NOTE: a store dropped without close() still unmounts its segment (Mooncake's does)
        self._finalizer = weakref.finalize(self, client.close)
        return client

    @property
    def client(self) -> StoreClient | None:
        """The client, or None (not logged: for calls that answer a state, not fail)."""
        return self._client

    @property
    def hostname(self) -> str:
        """This client's segment name, "host:port" ("" before setup, and for a dummy client)."""
        return self._hostname

    def ready(self) -> StoreClient | None:
        """The client, or None (logged: the call that asked fails) before setup / after close."""
        if self._client is None:
            logger.error("MooncakeDistributedStore: call setup() first")
        return self._client

    def close(self) -> None:
        """Unmount the segment and disconnect (idempotent). Mutates: no client afterwards."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._client is not None:
            self._client.close()
            self._client = None
        self._hostname = ""
