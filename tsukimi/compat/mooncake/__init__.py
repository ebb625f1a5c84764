"""Mooncake's Python API (`mooncake.store`, `mooncake.engine`, ...) on tsukimi.

Code written for Mooncake runs unchanged under `tsukimi compat exec -- CMD` (which makes
`import mooncake.*` resolve to these modules), or by changing its imports:

    from tsukimi.compat.mooncake import MooncakeDistributedStore, ReplicateConfig, TransferEngine

| `mooncake.` module        | here                      |
|---------------------------|---------------------------|
| `store`                   | store.py                  |
| `engine`                  | engine.py                 |
| `buffer_pool`             | buffer_pool.py            |

Every other module of the wheel has its namesake here, or a row in gaps.py saying why not.

Each of the two classes is Mooncake's API surface over parts that own their state (a store's
connection, objects, replicas, ranges, tensors...; an engine's local memory, synchronous and
batch transfers): the facade makes its parts and delegates every call (see each module).
"""

from tsukimi.compat.mooncake.buffer_pool import BufferPool, RegisteredBufferPool
from tsukimi.compat.mooncake.codes import code_of
from tsukimi.compat.mooncake.engine import TransferEngine
from tsukimi.compat.mooncake.store import MooncakeDistributedStore, ReplicateConfig

__all__ = [
    "BufferPool",
    "MooncakeDistributedStore",
    "RegisteredBufferPool",
    "ReplicateConfig",
    "TransferEngine",
    "code_of",
]
