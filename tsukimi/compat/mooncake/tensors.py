"""The tensor family of `MooncakeDistributedStore` (put_tensor / get_tensor, batch, with_tp,
with_parallelism, pub_tensor, upsert_tensor, into caller buffers), as a mixin of store.py's
class, over tsukimi's own tensor API."""

from __future__ import annotations


class TensorMethods:
    """Mixed into `MooncakeDistributedStore`; uses its `_ready()` (the StoreClient or None)."""
