"""`mooncake.store` on tsukimi: `MooncakeDistributedStore` and the types its calls take and
return, over tsukimi's `StoreClient` (the facade stores nothing itself).

Method names, positional signatures and return conventions follow Mooncake's (0.3.x): 0 or a
size on success, negative codes on failure (codes.py), `b""` for a missing key in `get`.
Errors are logged, not raised, as Mooncake does; arguments of the wrong type raise
TypeError, as Mooncake's bindings do. The class is assembled from parts:

| part                       | calls                                                              |
|----------------------------|--------------------------------------------------------------------|
| here                       | setup (positional or dict), puts, upserts, gets, buffers, removes   |
| replicas.py                | get_replica_desc, batch_replica_clear, remove_by_regex, copy/move   |
| ranges.py                  | get_into_ranges                                                     |
| multi_buffers.py           | batch_put_from_multi_buffers, batch_get_into_multi_buffers          |
| dummy.py                   | setup_dummy's pool: alloc_from_mem_pool                             |
| tensors.py                 | the tensor family                                                   |

A store whose object is garbage-collected is closed (its segment unmounted).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence

from tsukimi.compat.mooncake import dummy, setup_args
from tsukimi.compat.mooncake.buffers import BufferHandle, LocalBuffer, RegisteredBuffers
from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, OK, RPC_FAIL, code_of
from tsukimi.compat.mooncake.dummy import DummyMethods, MemPool
from tsukimi.compat.mooncake.multi_buffers import MultiBufferMethods
from tsukimi.compat.mooncake.ranges import RangeMethods
from tsukimi.compat.mooncake.replicas import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    QueryTaskResponse,
    ReplicaDescriptor,
    ReplicaMethods,
    ReplicaStatus,
    TaskStatus,
    TaskType,
)
from tsukimi.compat.mooncake.replicate import ReplicateConfig, SoftPinAction
from tsukimi.compat.mooncake.tensor_types import ParallelAxis, ReadTarget, TensorParallelism  # noqa: F401 (re-exported)
from tsukimi.compat.mooncake.tensors import TensorMethods
from tsukimi.errors import ConfigError, ObjectExists, TsukimiError
from tsukimi.store.client import StoreClient
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.segment import byte_view

logger = logging.getLogger(__name__)

__all__ = [
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "QueryTaskResponse",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
]
_SIZE = setup_args.DEFAULT_SIZE


class MooncakeDistributedStore(TensorMethods, ReplicaMethods, RangeMethods, MultiBufferMethods, DummyMethods):
    """`mooncake.store.MooncakeDistributedStore` on a `StoreClient`."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._buffers = RegisteredBuffers()
        self._local = LocalBuffer(0)
        self._pool: MemPool | None = None
        self._hostname = ""
        self._finalizer: weakref.finalize[[], MooncakeDistributedStore] | None = None

    def setup(
        self,
        local_hostname: str | Mapping[str, object],
        metadata_server: str | None = None,
        global_segment_size: int | str = _SIZE,
        local_buffer_size: int | str = _SIZE,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: object = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int:
        """Connect to the master and mount `global_segment_size` bytes; or `setup(config)`
        with Mooncake's dictionary (sizes may be "16MB"). `local_hostname` "host:port" names
        this client's segment (`get_hostname()`); a bare host gets a port in 12300..14300.
        `engine`: a `mooncake.engine.TransferEngine` to share. 0, or a negative code."""
        try:
            if isinstance(local_hostname, Mapping):
                if metadata_server is not None:
                    raise TypeError("setup(config) takes the dictionary alone")
                parsed = setup_args.from_dict(local_hostname)
            else:
                parsed = setup_args.from_args(
                    local_hostname,
                    metadata_server,  # type: ignore[arg-type]
                    global_segment_size,
                    local_buffer_size,
                    protocol,
                    rdma_devices,
                    master_server_addr,
                    enable_ssd_offload,
                    ssd_offload_path,
                    tenant_id,
                    enable_client_http_server,
                    client_http_port,
                )
            if enable_client_http_server:
                logger.warning("setup: the client HTTP server is not served by tsukimi (the master's /metrics is)")
            self._start(parsed, _shared_engine(engine))
        except (TsukimiError, OSError) as exc:
            logger.error("setup failed: %s", exc)
            return code_of(exc) if isinstance(exc, TsukimiError) else INVALID_PARAMS
        return OK

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Join the store through the standalone client at `server_address` (`tsukimi compat
        mooncake-client`, which holds the memory); a `mem_pool_size` pool of shared memory
        serves alloc_from_mem_pool. 0, or a negative code."""
        try:
            for name, value in (("mem_pool_size", mem_pool_size), ("local_buffer_size", local_buffer_size)):
                if not isinstance(value, int) or not 0 <= value <= setup_args.MAX_SIZE:
                    raise ConfigError(f"{name} must be a number of bytes in 0..1 TB, got {value!r}")
            welcome = dummy.hello(server_address)
            self._start(dummy.dummy_setup(welcome, server_address, local_buffer_size), None)
            assert self._client is not None
            self._hostname = ""  # NOTE: a dummy holds no segment, as in Mooncake
            self._pool = MemPool(self._client.engine, mem_pool_size) if mem_pool_size else None
        except (TsukimiError, OSError) as exc:
            logger.error("setup_dummy failed: %s", exc)
            self.close()
            return code_of(exc) if isinstance(exc, TsukimiError) else INVALID_PARAMS
        return OK

    def _start(self, parsed: setup_args.StoreSetup, engine: TransferEngine | None) -> None:
        if self._client is not None:  # NOTE: Mooncake answers a second setup with 0: it replaces the first
            logger.info("setup again: closing the previous client first")
            self.close()
        client = setup_args.connect(parsed, engine)
        self._client, self._local, self._hostname = client, LocalBuffer(parsed.local_buffer_size), client.engine.name
        self._finalizer = weakref.finalize(self, client.close)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        return self.setup("localhost", "P2PHANDSHAKE", mount_segment_size, _SIZE, protocol, device_name)

    # -- puts --------------------------------------------------------------------------

    def put(self, key: str, value: object, config: ReplicateConfig | None = None) -> int:
        return self._put([(key, value)], config, upsert=False, copy=True)[0]

    def upsert(self, key: str, value: object, config: ReplicateConfig | None = None) -> int:
        return self._put([(key, value)], config, upsert=True, copy=True)[0]

    def put_batch(self, keys: list[str], values: list[object], config: ReplicateConfig | None = None) -> int:
        return self._batch(keys, values, config, upsert=False)

    def upsert_batch(self, keys: list[str], values: list[object], config: ReplicateConfig | None = None) -> int:
        return self._batch(keys, values, config, upsert=True)

    def put_parts(self, key: str, *parts: object, config: ReplicateConfig | None = None) -> int:
        """One object from the concatenated `parts` (buffers)."""
        return self._put([(key, _joined(parts))], config, upsert=False, copy=True)[0]

    def upsert_parts(self, key: str, *parts: object, config: ReplicateConfig | None = None) -> int:
        return self._put([(key, _joined(parts))], config, upsert=True, copy=True)[0]

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._put_buffers(keys, buffer_ptrs, sizes, config, upsert=False)

    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._put_buffers(keys, buffer_ptrs, sizes, config, upsert=True)

    def _batch(self, keys: list[str], values: list[object], config: ReplicateConfig | None, upsert: bool) -> int:
        if len(keys) != len(values):
            logger.error("%d keys but %d values", len(keys), len(values))
            return INVALID_PARAMS
        codes = self._put(list(zip(keys, values, strict=True)), config, upsert, copy=True)
        return next((c for c in codes if c != OK), OK)

    def _put_buffers(
        self, keys: list[str], ptrs: list[int], sizes: list[int], config: ReplicateConfig | None, upsert: bool
    ) -> list[int]:
        if not len(keys) == len(ptrs) == len(sizes):
            logger.error("%d keys, %d buffers, %d sizes", len(keys), len(ptrs), len(sizes))
            return [INVALID_PARAMS] * len(keys)
        return self._put([(k, (ptr, n)) for k, ptr, n in zip(keys, ptrs, sizes, strict=True)], config, upsert, False)

    def _put(
        self, items: Sequence[tuple[str, object]], config: ReplicateConfig | None, upsert: bool, copy: bool
    ) -> list[int]:
        """Each item's code; `copy`: the bytes are Python's, staged within local_buffer_size."""
        if config is not None and not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
        client = self._ready()
        if client is None:
            return [RPC_FAIL] * len(items)
        codes = [OK] * len(items)
        views: list[tuple[str, memoryview]] = []
        slots: list[int] = []
        try:
            replica = (config or ReplicateConfig()).to_tsukimi(self._hostname)
            for i, (key, value) in enumerate(items):
                try:
                    view = byte_view(value, writable=False, with_address=False)[0]
                    if copy:
                        self._local.check(key, len(view))
                except TsukimiError as exc:
                    logger.error("put %r: %s", key, exc)
                    codes[i] = code_of(exc)
                    continue
                views.append((key, view))
                slots.append(i)
            errors = client.batch_put(views, upsert=upsert, config=replica)
        except TsukimiError as exc:
            logger.error("put failed: %s", exc)
            return [code_of(exc)] * len(items)
        for i, error in zip(slots, errors, strict=True):
            # NOTE: Mooncake answers a put of an existing key with success and keeps the old value
            codes[i] = OK if isinstance(error, ObjectExists) else code_of(error)
        return codes

    # -- gets --------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The value, or b"" when the key is missing or unreadable."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [b"" if data is None else bytes(data) for data in self._copies(keys, bytearray)]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value in a `BufferHandle`, or None (missing, unreadable)."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return [data if isinstance(data, BufferHandle) else None for data in self._copies(keys, BufferHandle)]

    def _copies(self, keys: list[str], allocate: type[bytearray]) -> list[bytearray | memoryview | None]:
        """Each value read into a new `allocate(size)` (None: missing, unreadable, or larger
        than the local buffer copies are staged in)."""
        client = self._ready()
        if client is None:
            return [None] * len(keys)
        try:
            results = client.batch_get(keys, allocate=allocate)
        except TsukimiError as exc:
            logger.error("get failed: %s", exc)
            return [None] * len(keys)
        out: list[bytearray | memoryview | None] = []
        for key, result in zip(keys, results, strict=True):
            try:
                data = result.value()
                if data is not None:
                    self._local.check(key, len(data))
            except TsukimiError as exc:
                logger.error("get %r: %s", key, exc)
                data = None
            out.append(data)
        return out

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Bytes read per key, or a negative code (-704 missing, -800 unreadable, -600 too small)."""
        client = self._ready()
        if client is None or not len(keys) == len(buffer_ptrs) == len(sizes):
            return [RPC_FAIL if client is None else INVALID_PARAMS] * len(keys)
        try:
            buffers = [byte_view((ptr, n))[0] for ptr, n in zip(buffer_ptrs, sizes, strict=True)]
            results = client.batch_get(keys, buffers)
        except TsukimiError as exc:
            logger.error("get failed: %s", exc)
            return [code_of(exc)] * len(keys)
        return [code_of(r.error) if r.error else r.size if r.found else OBJECT_NOT_FOUND for r in results]

    def get_size(self, key: str) -> int:
        client = self._ready()
        if client is None:
            return RPC_FAIL
        try:
            size = client.size_of(key)
        except TsukimiError as exc:
            return code_of(exc)
        return size if size is not None else OBJECT_NOT_FOUND

    # -- metadata ----------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 if the key exists, 0 if not, a negative code on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        client = self._ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        try:
            return [int(found) for found in client.batch_exists(keys)]
        except TsukimiError as exc:
            return [code_of(exc)] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        client = self._ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        codes = []
        for key in keys:
            try:
                codes.append(OK if client.remove(key, force) else OBJECT_NOT_FOUND)
            except TsukimiError as exc:
                codes.append(code_of(exc))
        return codes

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed, or a negative code."""
        client = self._ready()
        if client is None:
            return RPC_FAIL
        try:
            return client.remove_all(force)
        except TsukimiError as exc:
            return code_of(exc)

    def get_offload_rpc_read_count(self) -> int:
        """How many objects this client read from a holder's disk."""
        return self._client.disk_reads if self._client is not None else 0

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Record a buffer (get_into_ranges writes inside registered buffers only; any other
        call reads and writes any memory). -600 for a null or overlapping range."""
        try:
            self._buffers.register(buffer_ptr, size)
        except TsukimiError as exc:
            logger.error("register_buffer: %s", exc)
            return INVALID_PARAMS
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            self._buffers.unregister(buffer_ptr)
        except TsukimiError as exc:
            logger.error("unregister_buffer: %s", exc)
            return INVALID_PARAMS
        return OK

    def get_hostname(self) -> str:
        """This client's segment name, "host:port" ("" before setup, and for a dummy client)."""
        return self._hostname

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 the master does not answer (as Mooncake)."""
        if self._client is None:
            return 1
        try:
            self._client.exists("__tsukimi_health_check__")
        except TsukimiError:
            return 2
        return 0

    def close(self) -> int:
        """Unmount this client's segment (its objects are gone) and disconnect."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._client is not None:
            self._client.close()
            self._client = None
        self._pool, self._hostname, self._buffers = None, "", RegisteredBuffers()
        return OK

    def _ready(self) -> StoreClient | None:
        if self._client is None:
            logger.error("MooncakeDistributedStore: call setup() first")
        return self._client


def _joined(parts: Sequence[object]) -> object:
    """The parts as one buffer (one copy), or the offending part itself (refused later)."""
    try:
        return bytearray().join(parts)  # type: ignore[arg-type]
    except TypeError:
        return next((p for p in parts if not isinstance(p, bytes | bytearray | memoryview)), b"")


def _shared_engine(engine: object) -> TransferEngine | None:
    """tsukimi's engine inside a `mooncake.engine.TransferEngine` (None: none given)."""
    if engine is None:
        return None
    inner = getattr(engine, "_engine", None)
    if not isinstance(inner, TransferEngine):
        raise ConfigError("engine must be an initialized mooncake.engine.TransferEngine")
    return inner
