"""`mooncake.store` on tsukimi: `MooncakeDistributedStore` and the types its calls take and
return, over tsukimi's `StoreClient` (the facade stores no object itself).

Method names, positional signatures and return conventions follow Mooncake's (0.3.x): 0 or a
size on success, negative codes on failure (codes.py), `b""` for a missing key in `get`.
Errors are logged, not raised, as Mooncake does; arguments of the wrong type raise
TypeError, as Mooncake's bindings do.

The class is Mooncake's API surface and nothing else: `setup` connects, and every other call
is delegated to the part that owns what it works on. Each part is given what it needs when the
store makes it (the connection, the registered buffers) and keeps its own state:

| part                                 | owns / does                                                   |
|--------------------------------------|---------------------------------------------------------------|
| connection.py `StoreConnection`      | the StoreClient, the segment name, closing on collection      |
| objects.py `ObjectCalls`             | the local buffer; puts, upserts, gets, sizes, exists, removes |
| buffers.py `RegisteredBuffers`       | the ranges given to register_buffer                           |
| replicas.py `ReplicaAdmin`           | replica descriptors, replica clear, remove_by_regex, tasks    |
| ranges.py `RangeReads`               | get_into_ranges (inside the registered buffers)               |
| multi_buffers.py `MultiBufferCalls`  | batch_put_from_multi_buffers, batch_get_into_multi_buffers    |
| sessions.py `GetSessions`            | get sessions and batch_get_into_multi_buffer_ranges           |
| sessions.py `PutSessions`            | put sessions and batch_put_from_multi_buffer_ranges           |
| dummy.py `MemPool`                   | setup_dummy's pool: alloc_from_mem_pool                       |
| tensors.py `Tensors`                 | the tensor family, with_tp included                           |
| tensor_parallel.py `ParallelTensors` | the with_parallelism family                                   |
| safetensor_files.py                  | save_tensor_to_safetensor / load_tensor_from_safetensor       |
| segments.py `MountedSegments`        | segments mounted after setup, their memory; the disk's unmount|

Also named here, as in the wheel: `BufferPool` and its leases (buffer_pool.py, over this
store's register_buffer), `ObjectDataType` (replicate.py), `bind_to_numa_node` (numa.py), and
every enum value at module level (pybind11's export_values). What of the wheel's surface is
missing, and why: gaps.py.

Parts never reach into one another; the facade makes them in `__init__` (and a new
`ObjectCalls` per setup, with that setup's local buffer size) and owns nothing else but
setup_dummy's `MemPool`.

A store whose object is garbage-collected is closed (its segment unmounted).
"""

from __future__ import annotations

import logging

import torch

from tsukimi.compat.mooncake import dummy, safetensor_files, setup_args
from tsukimi.compat.mooncake.buffer_pool import BufferLease, BufferLeaseView, BufferPool, RegisteredBufferPool
from tsukimi.compat.mooncake.buffers import BufferHandle, LocalBuffer, RegisteredBuffers
from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OK, code_of
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.compat.mooncake.dummy import MemPool
from tsukimi.compat.mooncake.engine import TransferEngine as EngineFacade
from tsukimi.compat.mooncake.host_alloc import MooncakeHostMemAllocator
from tsukimi.compat.mooncake.multi_buffers import MultiBufferCalls
from tsukimi.compat.mooncake.numa import bind_to_numa_node
from tsukimi.compat.mooncake.objects import ObjectCalls, joined
from tsukimi.compat.mooncake.ranges import RangeReads, Ranges
from tsukimi.compat.mooncake.replicas import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    QueryTaskResponse,
    ReplicaAdmin,
    ReplicaDescriptor,
    ReplicaStatus,
    TaskId,
    TaskStatus,
    TaskType,
)
from tsukimi.compat.mooncake.replicate import ObjectDataType, ReplicateConfig, SoftPinAction
from tsukimi.compat.mooncake.segments import MountedSegments, MountResult
from tsukimi.compat.mooncake.sessions import GetSessions, PutSessions
from tsukimi.compat.mooncake.tensor_calls import ReplicaSettings
from tsukimi.compat.mooncake.tensor_parallel import ParallelTensors
from tsukimi.compat.mooncake.tensor_types import ParallelAxis, ReadTarget, TensorParallelism  # noqa: F401 (re-exported)
from tsukimi.compat.mooncake.tensors import Tensors
from tsukimi.errors import ConfigError, TsukimiError
from tsukimi.store.client import StoreClient
from tsukimi.transfer import TransferEngine

logger = logging.getLogger(__name__)

__all__ = [
    "BufferHandle",
    "BufferLease",
    "BufferLeaseView",
    "BufferPool",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "MooncakeHostMemAllocator",
    "ObjectDataType",
    "QueryTaskResponse",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "RegisteredBufferPool",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "bind_to_numa_node",
]
_SIZE = setup_args.DEFAULT_SIZE

RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView
# NOTE: pybind11's export_values(): the wheel's store module also names every enum value; where
# two enums share a name (FAILED, PROCESSING) the task status, bound last, wins there as here.
UNDEFINED, INITIALIZED, COMPLETE, REMOVED = (
    ReplicaStatus[n] for n in ("UNDEFINED", "INITIALIZED", "COMPLETE", "REMOVED")
)
REPLICA_COPY, REPLICA_MOVE = TaskType.REPLICA_COPY, TaskType.REPLICA_MOVE
PENDING, PROCESSING, FAILED, SUCCESS = (TaskStatus[n] for n in ("PENDING", "PROCESSING", "FAILED", "SUCCESS"))
UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE = (
    ObjectDataType[n] for n in ("UNKNOWN", "KVCACHE", "TENSOR", "WEIGHT", "SAMPLE")
)
ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA, GENERAL = (
    ObjectDataType[n] for n in ("ACTIVATION", "GRADIENT", "OPTIMIZER_STATE", "METADATA", "GENERAL")
)
Config = ReplicaSettings | None  # a tensor call's ReplicateConfig


class MooncakeDistributedStore:
    """`mooncake.store.MooncakeDistributedStore` on a `StoreClient` (see the module)."""

    def __init__(self) -> None:
        self._connection = StoreConnection()
        self._buffers = RegisteredBuffers()
        self._objects = ObjectCalls(self._connection, LocalBuffer(0))
        self._pool: MemPool | None = None
        self._replicas = ReplicaAdmin(self._connection)
        self._ranges = RangeReads(self._connection, self._buffers)
        self._multi_buffers = MultiBufferCalls(self._connection)
        self._tensors = Tensors(self._connection)
        self._parallel = ParallelTensors(self._connection)
        self._get_sessions = GetSessions(self._connection)
        self._put_sessions = PutSessions(self._connection)
        self._segments = MountedSegments(self._connection)

    def setup(self, *args: object, **kwargs: object) -> int:
        """Connect to the master and mount `global_segment_size` bytes. Mooncake's two forms:

            setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
                  protocol, rdma_devices, master_server_addr, engine=None,
                  enable_ssd_offload=False, ssd_offload_path="", tenant_id="default",
                  enable_client_http_server=False, client_http_port=9300)
            setup(config)    # or setup(config=...): Mooncake's dictionary (sizes may be "16MB")

        `local_hostname` "host:port" names this client's segment (`get_hostname()`); a bare
        host gets a port in 12300..14300. `engine`: a `mooncake.engine.TransferEngine` to
        share, or what its `get_engine()` returned (SGLang passes that). 0, or a negative code.
        Raises TypeError, as the wheel does, for a call neither form binds (setup_args.bind)."""
        call = setup_args.bind(args, kwargs)
        try:
            parsed = call.parse()
            if call.client_http_server:
                logger.warning("setup: the client HTTP server is not served by tsukimi (the master's /metrics is)")
            self._start(parsed, _shared_engine(call.engine))
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
            # NOTE: a dummy holds no segment, as in Mooncake: its hostname is ""
            setup = dummy.dummy_setup(welcome, server_address, local_buffer_size)
            client = self._start(setup, None, holds_segment=False)
            self._pool = MemPool(client.engine, mem_pool_size) if mem_pool_size else None
        except (TsukimiError, OSError) as exc:
            logger.error("setup_dummy failed: %s", exc)
            self.close()
            return code_of(exc) if isinstance(exc, TsukimiError) else INVALID_PARAMS
        return OK

    def _start(
        self, parsed: setup_args.StoreSetup, engine: TransferEngine | None, holds_segment: bool = True
    ) -> StoreClient:
        """Connect (closing a previous client first) and give the object calls this setup's
        local buffer. Raises what `StoreConnection.open` raises."""
        if self._connection.client is not None:  # NOTE: Mooncake answers a second setup with 0: it replaces the first
            logger.info("setup again: closing the previous client first")
            self.close()
        client = self._connection.open(parsed, engine, holds_segment)
        self._objects = ObjectCalls(self._connection, LocalBuffer(parsed.local_buffer_size))
        return client

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        return self.setup("localhost", "P2PHANDSHAKE", mount_segment_size, _SIZE, protocol, device_name)

    # -- puts ------------------------------------------------------------------------------

    def put(self, key: str, value: object, config: ReplicateConfig | None = None) -> int:
        return self._objects.put([(key, value)], config, upsert=False, copy=True)[0]

    def upsert(self, key: str, value: object, config: ReplicateConfig | None = None) -> int:
        return self._objects.put([(key, value)], config, upsert=True, copy=True)[0]

    def put_batch(self, keys: list[str], values: list[object], config: ReplicateConfig | None = None) -> int:
        return self._objects.put_batch(keys, values, config, upsert=False)

    def upsert_batch(self, keys: list[str], values: list[object], config: ReplicateConfig | None = None) -> int:
        return self._objects.put_batch(keys, values, config, upsert=True)

    def put_parts(self, key: str, *parts: object, config: ReplicateConfig | None = None) -> int:
        """One object from the concatenated `parts` (buffers)."""
        return self._objects.put([(key, joined(parts))], config, upsert=False, copy=True)[0]

    def upsert_parts(self, key: str, *parts: object, config: ReplicateConfig | None = None) -> int:
        return self._objects.put([(key, joined(parts))], config, upsert=True, copy=True)[0]

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._objects.put_buffers(keys, buffer_ptrs, sizes, config, upsert=False)

    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        return self._objects.put_buffers(keys, buffer_ptrs, sizes, config, upsert=True)

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Put each key from its buffers, concatenated (zero-copy): 0 or a negative code per
        key (multi_buffers.py)."""
        return self._multi_buffers.put(keys, all_buffer_ptrs, all_sizes, config)

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """One object: the `metadata_size` bytes at `metadata_buffer_ptr`, then the `size`
        bytes at `buffer_ptr` (zero-copy; an empty or null part is left out, as the wheel):
        0 or a negative code."""
        parts = [(p, n) for p, n in ((metadata_buffer_ptr, metadata_size), (buffer_ptr, size)) if p and n]
        ptrs, sizes = [p for p, _ in parts], [n for _, n in parts]
        return self.batch_put_from_multi_buffers([key], [ptrs], [sizes], config)[0]

    # -- gets ------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The value, or b"" when the key is missing or unreadable."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return self._objects.get_bytes(keys)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value in a `BufferHandle`, or None (missing, unreadable)."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return self._objects.get_handles(keys)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Bytes read per key, or a negative code (-704 missing, -800 unreadable, -600 too small)."""
        return self._objects.get_into(keys, buffer_ptrs, sizes)

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Read each key into its buffers, in order: the bytes read, or a negative code per
        key (multi_buffers.py). `prefer_alloc_in_same_node` is accepted and has no effect
        (tsukimi reads a replica on this host through shared memory or CMA whichever way)."""
        return self._multi_buffers.get(keys, all_buffer_ptrs, all_sizes)

    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: Ranges,
        all_src_offsets: Ranges,
        all_sizes: Ranges,
    ) -> Ranges:
        """Per buffer, per key, per range: bytes read or a negative code (ranges.py)."""
        return self._ranges.read(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes)

    def get_size(self, key: str) -> int:
        return self._objects.size_of(key)

    # -- sessions: objects read or written range by range, one call per layer (sessions.py) --

    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        """Look the keys up once (a read lease) and keep their replicas: 0 or a negative code per key."""
        return self._get_sessions.start(keys)

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_src_offsets: list[list[int]],
    ) -> list[int]:
        """Per key, read `all_sizes[i][j]` bytes from object offset `all_src_offsets[i][j]`
        into `all_buffer_ptrs[i][j]` with its get session: bytes read or a negative code."""
        return self._get_sessions.read(keys, all_buffer_ptrs, all_sizes, all_src_offsets)

    def batch_get_session_end(self, keys: list[str]) -> int:
        """Drop the keys' get sessions (local): 0."""
        return self._get_sessions.end(keys)

    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Reserve the objects (not readable until their session ends): 0 or a negative code per key."""
        return self._put_sessions.start(keys, sizes, config)

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        """Per key, write `all_sizes[i][j]` bytes from `all_buffer_ptrs[i][j]` at object offset
        `all_dst_offsets[i][j]` with its put session: bytes written or a negative code."""
        return self._put_sessions.write(keys, all_buffer_ptrs, all_sizes, all_dst_offsets)

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Complete the keys' puts (readable from now on): 0 or a negative code per key."""
        return self._put_sessions.end(keys)

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        """Drop the keys' unfinished puts: 0 or a negative code per key."""
        return self._put_sessions.revoke(keys)

    # -- metadata and removal --------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 if the key exists, 0 if not, a negative code on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._objects.exist(keys)

    def remove(self, key: str, force: bool = False) -> int:
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return self._objects.remove(keys, force)

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed, or a negative code."""
        return self._objects.remove_all(force)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many objects whose keys match were removed, or a negative code."""
        return self._replicas.remove_matching(regex_pattern, force)

    def get_offload_rpc_read_count(self) -> int:
        """How many objects this client read from a holder's disk."""
        client = self._connection.client
        return client.disk_reads if client is not None else 0

    # -- replicas and tasks ----------------------------------------------------------------

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The replicas of `key` ([] when there is none, or on error, logged)."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """The replicas of each key that has an object (others are left out)."""
        return self._replicas.describe(keys)

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Clear the replicas (all, or those in `segment_name`) of the keys whose leases have
        ended; the keys cleared. Invalid keys are logged and skipped."""
        return self._replicas.clear(keys, segment_name)

    def create_copy_task(self, key: str, targets: list[str]) -> tuple[TaskId, int]:
        """(task id, 0), or ((0, 0), a negative code). TypeError for targets not a list of str."""
        return self._replicas.copy(key, targets)

    def create_move_task(self, key: str, source: str, target: str) -> tuple[TaskId, int]:
        """(task id, 0), or ((0, 0), a negative code)."""
        return self._replicas.move(key, source, target)

    def query_task(self, task_id: TaskId) -> tuple[QueryTaskResponse | None, int]:
        """(the task's state, 0), or (None, a negative code: -1400 for an unknown task)."""
        return self._replicas.query(task_id)

    # -- buffers ---------------------------------------------------------------------------

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

    def alloc_from_mem_pool(self, size: int) -> int:
        """The address of `size` bytes of the dummy's shared-memory pool; 0 on failure (not
        a dummy client, or no room)."""
        if not isinstance(size, int) or self._pool is None:
            logger.error("alloc_from_mem_pool: needs setup_dummy with a mem_pool_size, and a size in bytes")
            return 0
        return self._pool.alloc(size)

    # -- tensors ---------------------------------------------------------------------------

    def put_tensor(self, key: str, tensor: torch.Tensor) -> int:
        return self.batch_pub_tensor([key], [tensor])[0]

    def upsert_tensor(self, key: str, tensor: torch.Tensor) -> int:
        return self.batch_upsert_pub_tensor([key], [tensor])[0]

    def pub_tensor(self, key: str, tensor: torch.Tensor, config: Config = None) -> int:
        return self.batch_pub_tensor([key], [tensor], config)[0]

    def upsert_pub_tensor(self, key: str, tensor: torch.Tensor, config: Config = None) -> int:
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[torch.Tensor]) -> list[int]:
        return self.batch_pub_tensor(keys, tensors_list)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[torch.Tensor]) -> list[int]:
        return self.batch_upsert_pub_tensor(keys, tensors_list)

    def batch_pub_tensor(self, keys: list[str], tensors_list: list[torch.Tensor], config: Config = None) -> list[int]:
        return self._tensors.put(keys, tensors_list, config, upsert=False)

    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list[torch.Tensor], config: Config = None
    ) -> list[int]:
        return self._tensors.put(keys, tensors_list, config, upsert=True)

    def get_tensor(self, key: str) -> torch.Tensor | None:
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list[torch.Tensor | None]:
        return self._tensors.get(keys)

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> torch.Tensor | None:
        got = self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]
        return None if isinstance(got, int) else got

    def batch_get_tensor_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[torch.Tensor | None] | list[int]:
        """Each tensor read into its buffer (a view of it), or None (miss, too small, ...);
        as Mooncake, a negative code per key when the lists differ in length."""
        return self._tensors.get_into(keys, buffer_ptrs, sizes)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """Store `[header][payload]` buffers as they are (zero-copy)."""
        return self._tensors.put_from(keys, buffer_ptrs, sizes, upsert=False)

    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._tensors.put_from(keys, buffer_ptrs, sizes, upsert=True)

    # -- tensor parallelism: TP shards -----------------------------------------------------

    def put_tensor_with_tp(
        self, key: str, tensor: torch.Tensor, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        return self.batch_pub_tensor_with_tp([key], [tensor], None, tp_rank, tp_size, split_dim)[0]

    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: torch.Tensor,
        config: Config = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        return self.batch_pub_tensor_with_tp([key], [tensor], config, tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[torch.Tensor],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size, split_dim)

    def batch_pub_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[torch.Tensor],
        config: Config = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """Every shard of every tensor; -600 for a tensor that does not split evenly."""
        return self._tensors.put_with_tp(base_keys, tensors_list, config, tp_rank, tp_size, split_dim)

    def put_tensor_with_tp_from(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """The whole tensors held in `[header][payload]` buffers, cut and stored as with_tp."""
        return self._tensors.put_with_tp_from(base_keys, buffer_ptrs, sizes, tp_rank, tp_size, split_dim)

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> torch.Tensor | None:
        return self.batch_get_tensor_with_tp([key], tp_rank, tp_size)[0]

    def batch_get_tensor_with_tp(
        self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list[torch.Tensor | None]:
        return self._tensors.get_with_tp(base_keys, tp_rank, tp_size)

    def get_tensor_with_tp_into(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> torch.Tensor | None:
        return self.batch_get_tensor_with_tp_into([key], [buffer_ptr], [size], tp_rank, tp_size)[0]

    def batch_get_tensor_with_tp_into(
        self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int], tp_rank: int = 0, tp_size: int = 1
    ) -> list[torch.Tensor | None]:
        return self._tensors.get_with_tp_into(base_keys, buffer_ptrs, sizes, tp_rank, tp_size)

    # -- tensor parallelism: layouts and writer partitions ---------------------------------

    def put_tensor_with_parallelism(
        self,
        key: str,
        tensor: torch.Tensor,
        parallelism: object = None,
        config: Config = None,
        writer_partition: object = None,
    ) -> int:
        return self._parallel.put([key], lambda: [tensor], [parallelism], [writer_partition], config, upsert=False)[0]

    def upsert_tensor_with_parallelism(
        self,
        key: str,
        tensor: torch.Tensor,
        parallelism: object = None,
        config: Config = None,
        writer_partition: object = None,
    ) -> int:
        return self._parallel.put([key], lambda: [tensor], [parallelism], [writer_partition], config, upsert=True)[0]

    def batch_put_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[torch.Tensor],
        parallelisms: object = None,
        config: Config = None,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._parallel.put(keys, lambda: tensors_list, parallelisms, writer_partitions, config, upsert=False)

    def batch_upsert_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[torch.Tensor],
        parallelisms: object = None,
        config: Config = None,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._parallel.put(keys, lambda: tensors_list, parallelisms, writer_partitions, config, upsert=True)

    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: Config = None,
        writer_partition: object = None,
    ) -> int:
        return self._parallel.put_from([key], [buffer_ptr], [size], [parallelism], [writer_partition], config, False)[0]

    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: Config = None,
        writer_partition: object = None,
    ) -> int:
        return self._parallel.put_from([key], [buffer_ptr], [size], [parallelism], [writer_partition], config, True)[0]

    def batch_put_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: Config = None,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._parallel.put_from(keys, buffer_ptrs, sizes, parallelisms, writer_partitions, config, False)

    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: Config = None,
        writer_partitions: object = None,
    ) -> list[int]:
        return self._parallel.put_from(keys, buffer_ptrs, sizes, parallelisms, writer_partitions, config, True)

    # -- tensor parallelism: reads of layouts ----------------------------------------------

    def get_tensor_with_parallelism(self, key: str, target: object = None) -> torch.Tensor | None:
        return self.batch_get_tensor_with_parallelism([key], None if target is None else [target])[0]

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: object = None) -> list[torch.Tensor | None]:
        return self._parallel.get(keys, targets)

    def get_tensor_with_parallelism_into(
        self, key: str, buffer_ptr: int, size: int, target: object = None
    ) -> torch.Tensor | None:
        targets = None if target is None else [target]
        return self.batch_get_tensor_with_parallelism_into([key], [buffer_ptr], [size], targets)[0]

    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: object = None
    ) -> list[torch.Tensor | None]:
        """Each key read as its target asks, into its buffer (a view of it)."""
        return self._parallel.get_into(keys, buffer_ptrs, sizes, targets)

    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Write the tensor under `key` to a safetensors file: 0 or a negative code
        (safetensor_files.py)."""
        return safetensor_files.save(self.get_tensor, key, file_name)

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = "") -> torch.Tensor | None:
        """Put a safetensors file's tensor under `key`; the tensor, or None (safetensor_files.py)."""
        return safetensor_files.load(self.put_tensor, key, file_name)

    # -- the client ------------------------------------------------------------------------

    def get_hostname(self) -> str:
        """This client's segment name, "host:port" ("" before setup, and for a dummy client)."""
        return self._connection.hostname

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 the master does not answer (as Mooncake)."""
        client = self._connection.client
        if client is None:
            return 1
        try:
            client.exists("__tsukimi_health_check__")
        except TsukimiError:
            return 2
        return 0

    # -- segments mounted after setup (segments.py) ----------------------------------------

    def mount_segment(
        self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = ""
    ) -> MountResult:
        """Map [offset, offset + size) of the file at `path` (e.g. in /dev/shm) and mount it as
        another segment: {"ret": 0 or a code, "segment_ids": [...]}."""
        return self._segments.mount(path, size, offset, protocol, location)

    def unmount_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        """Unmount segments `mount_segment` mounted; 0, or the first failure's code."""
        return self._segments.unmount(segment_ids, grace_period_seconds, allocated=False)

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp", location: str = "") -> MountResult:
        """Allocate `size` bytes (rounded up to 16 MiB) and mount them: {"ret", "segment_ids",
        "allocated_size"}."""
        return self._segments.allocate(size, protocol, location)

    def unmount_and_free_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        """Unmount segments `allocate_and_mount_segment` mounted, and free them; 0 or a code."""
        return self._segments.unmount(segment_ids, grace_period_seconds, allocated=True)

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """Withdraw this holder's disk tier after the grace period; 0 (also with none) or a code."""
        return self._segments.unmount_local_disk(grace_period_seconds)

    def close(self) -> int:
        """Unmount this client's segment (its objects are gone) and disconnect."""
        self._put_sessions.clear()  # NOTE: before the client goes: it revokes the open puts
        self._get_sessions.clear()
        self._connection.close()
        self._segments.clear()  # NOTE: after: the client unmounted them at the master first
        self._pool = None
        self._buffers.clear()
        return OK

    def _ready(self) -> StoreClient | None:
        """The client, or None (logged) before setup / after close."""
        return self._connection.ready()


def _shared_engine(engine: object) -> TransferEngine | None:
    """tsukimi's engine from what `setup(..., engine)` was given (None: none given): a
    `mooncake.engine.TransferEngine`, or what its `get_engine()` returned (SGLang's HiCache
    passes that when it shares its PD engine: `SGLANG_HICACHE_MOONCAKE_REUSE_TE`)."""
    if engine is None:
        return None
    if isinstance(engine, TransferEngine):
        return engine
    wrong = ConfigError(
        "engine must be an initialized mooncake.engine.TransferEngine or what its get_engine() returned,"
        f" got {type(engine).__name__}"
    )
    if not isinstance(engine, EngineFacade):
        raise wrong
    try:
        return engine.get_engine()
    except ConfigError:
        raise wrong from None
