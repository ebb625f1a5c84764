"""What the parts of `MooncakeDistributedStore` share: the parts (replicas.py, ranges.py,
dummy.py) are mixins of store.py's class, each over the same `StoreClient` and the same
registered buffers; this base declares them.
"""

from __future__ import annotations

from tsukimi.compat.mooncake.buffers import RegisteredBuffers
from tsukimi.store.client import StoreClient


class StoreBase:
    """Declares what store.py's `MooncakeDistributedStore` provides to its mixins."""

    _buffers: RegisteredBuffers

    def _ready(self) -> StoreClient | None:
        """The client, or None (logged) before setup / after close: store.py's."""
        raise NotImplementedError
