"""`mooncake.store` on tsukimi: `MooncakeDistributedStore` and its configuration types.

Method names, positional signatures and return conventions follow Mooncake's (0.3.x): 0 or a
size on success, negative codes on failure (codes.py), `b""` for a missing key in `get`.
Errors are logged, not raised, as Mooncake does. The storage is tsukimi's `StoreClient`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tsukimi.compat.mooncake import offload
from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, OK, RPC_FAIL, code_of
from tsukimi.compat.mooncake.tensors import TensorMethods
from tsukimi.config import ClientConfig, Config, MetadataConfig, TransferConfig
from tsukimi.errors import ObjectExists, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.client import StoreClient
from tsukimi.transfer.segment import byte_view

logger = logging.getLogger(__name__)


class ReplicateConfig:
    """`mooncake.store.ReplicateConfig`: plain attributes, set after construction."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []

    def _to_tsukimi(self) -> p.ReplicaConfig:
        preferred = [self.preferred_segment] if self.preferred_segment else []
        return p.ReplicaConfig(self.replica_num, self.with_soft_pin, self.with_hard_pin,
                               tuple(preferred + list(self.preferred_segments)))  # fmt: skip


class MooncakeDistributedStore(TensorMethods):
    """`mooncake.store.MooncakeDistributedStore` on a `StoreClient`."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int = 0,
        local_buffer_size: int = 0,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: object = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        **_ignored: object,
    ) -> int:
        """Connect to the master at host:port and mount `global_segment_size` bytes.
        `local_buffer_size` needs no pre-allocation here (any buffer can be read into);
        "tcp" lets same-host peers use shared memory, as tsukimi's transport choice is per peer.
        A master that offloads gives the client a disk too (offload.py)."""
        try:
            url = "p2p" if metadata_server.upper() in ("P2PHANDSHAKE", "") else metadata_server
            transport = "tcp" if protocol == "tcp-only" else "auto"
            master = f"tcp://{master_server_addr}"
            root = offload.disk_root(master, enable_ssd_offload, ssd_offload_path) if global_segment_size else ""
            ssd_dir, ssd_bytes = offload.free_slot(root) if root else ("", 0)
            client = ClientConfig(master, global_segment_size, ssd_dir=ssd_dir, ssd_bytes=ssd_bytes)
            transfer = TransferConfig(transport=transport)
            self._client = StoreClient(Config(transfer=transfer, metadata=MetadataConfig(url=url), client=client))
        except (TsukimiError, OSError) as exc:
            logger.error("setup failed: %s", exc)
            return code_of(exc) if isinstance(exc, TsukimiError) else INVALID_PARAMS
        return OK

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        return self.setup("localhost", "P2PHANDSHAKE", mount_segment_size, 0, protocol, device_name)

    # -- puts --------------------------------------------------------------------------

    def put(self, key: str, value: object, config: ReplicateConfig | None = None) -> int:
        return self._put([(key, value)], config, upsert=False)[0]

    def upsert(self, key: str, value: object, config: ReplicateConfig | None = None) -> int:
        return self._put([(key, value)], config, upsert=True)[0]

    def put_batch(self, keys: list[str], values: list[object], config: ReplicateConfig | None = None) -> int:
        codes = self._put(list(zip(keys, values, strict=True)), config, upsert=False)
        return next((c for c in codes if c != OK), OK)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self._put([(key, (buffer_ptr, size))], config, upsert=True)[0]

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return self._put([(k, (ptr, n)) for k, ptr, n in zip(keys, buffer_ptrs, sizes, strict=True)], config, False)

    def _put(self, items: Sequence[tuple[str, object]], config: ReplicateConfig | None, upsert: bool) -> list[int]:
        client = self._ready()
        if client is None:
            return [RPC_FAIL] * len(items)
        try:
            rc = (config or ReplicateConfig())._to_tsukimi()
            pin = "hard" if rc.hard_pin else "soft" if rc.soft_pin else ""
            errors = client.batch_put(items, rc.replicas, pin, rc.preferred_segments, upsert=upsert)
        except TsukimiError as exc:
            logger.error("put failed: %s", exc)
            return [code_of(exc)] * len(items)
        # NOTE: Mooncake answers a put of an existing key with success and keeps the old value
        return [OK if isinstance(e, ObjectExists) else code_of(e) for e in errors]

    # -- gets --------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The value, or b"" when the key is missing or unreadable."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        client = self._ready()
        if client is None:
            return [b""] * len(keys)
        try:
            return [bytes(r.data) if r.data is not None else b"" for r in client.batch_get(keys)]
        except TsukimiError as exc:
            logger.error("get failed: %s", exc)
            return [b""] * len(keys)

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

    def get_replica_desc(self, key: str) -> list[offload.ReplicaDescriptor]:
        """The key's replicas (memory first, then disk copies); [] when it does not exist."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[offload.ReplicaDescriptor]]:
        """Each existing key's replicas (a missing key is left out)."""
        client = self._ready()
        if client is None:
            return {}
        try:
            return offload.replica_descriptors(client, keys)
        except TsukimiError as exc:
            logger.error("batch_get_replica_desc failed: %s", exc)
            return {}

    def get_offload_rpc_read_count(self) -> int:
        """How many objects this client read from a holder's disk."""
        return self._client.disk_reads if self._client is not None else 0

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Accepted for compatibility: tsukimi reads into and writes from any buffer."""
        return OK if buffer_ptr > 0 and size > 0 else INVALID_PARAMS

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return OK

    def get_hostname(self) -> str:
        client = self._ready()
        return client.engine.name if client is not None else ""

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
        if self._client is not None:
            self._client.close()
            self._client = None
        return OK

    def _ready(self) -> StoreClient | None:
        if self._client is None:
            logger.error("MooncakeDistributedStore: call setup() first")
        return self._client
