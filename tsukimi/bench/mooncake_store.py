"""The real Mooncake Store's client as a baseline: `MooncakeStoreAdapter` (a pure client,
`global_segment_size=0`, used inside whichever process runs the timed loop, with two
registered page-aligned buffers) over a `MooncakeCluster` (bench/mooncake_cluster.py), and a
self-test (`python -m tsukimi.bench.child mooncake-store selftest`).
"""

from __future__ import annotations

import argparse
import logging
import mmap
import sys

import numpy as np
import numpy.typing as npt

from tsukimi.bench.mooncake_cluster import (
    LOCAL_BUFFER_BYTES,
    METADATA,
    MIB,
    MooncakeCluster,
    ReplicateConfigLike,
    mooncake_store_available,
    new_store,
    protocol_stream,
    unique_hostname,
)
from tsukimi.clock import WallClock
from tsukimi.errors import ClosedError, ConfigError, OutOfBounds

logger = logging.getLogger(__name__)


class MooncakeStoreAdapter:
    """A Mooncake Store client inside this process, over two registered buffers `src`, `dst`.

    Puts read from `src`, gets write into `dst`; offsets are byte offsets into those buffers.
    The caller should have pointed fd 1 away from any protocol stream it uses (the C++ library
    may print to stdout). Sets the `MOONCAKE_ENV` variables in this process if unset.

    Args:
        master_addr: "127.0.0.1:PORT" of the master (`MooncakeCluster.master_addr`).
        buffer_bytes: size of each of `src` and `dst`.

    Raises:
        ConfigError: bad `buffer_bytes`. RuntimeError: setup or registration failed (the code).
    """

    def __init__(self, master_addr: str, buffer_bytes: int) -> None:
        if buffer_bytes <= 0:
            raise ConfigError(f"buffer_bytes must be > 0, got {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self._store, self._new_config = new_store()
        self._configs: dict[int, ReplicateConfigLike] = {}
        self._registered: list[int] = []
        self.hostname = unique_hostname()
        # NOTE: global_segment_size=0 is accepted: the client mounts nothing ("skip mounting").
        _check(self._store.setup(self.hostname, METADATA, 0, LOCAL_BUFFER_BYTES, "tcp", "", master_addr), "setup")
        self._closed = False
        # NOTE: the mmaps are never closed explicitly: numpy views export their buffers, so
        # mmap.close() would raise while a caller still holds `src`/`dst`; GC unmaps them.
        self.src: npt.NDArray[np.uint8] = np.frombuffer(mmap.mmap(-1, buffer_bytes), dtype=np.uint8)
        self.dst: npt.NDArray[np.uint8] = np.frombuffer(mmap.mmap(-1, buffer_bytes), dtype=np.uint8)
        self.src.fill(0)  # fault every page in before anything is timed
        self.dst.fill(0)
        self._src_addr, self._dst_addr = int(self.src.ctypes.data), int(self.dst.ctypes.data)
        try:
            for addr in (self._src_addr, self._dst_addr):
                _check(self._store.register_buffer(addr, buffer_bytes), "register_buffer")
                self._registered.append(addr)
        except BaseException:
            self.close()
            raise

    def _config(self, replicas: int) -> ReplicateConfigLike:
        if replicas not in self._configs:
            config = self._new_config()
            config.replica_num = replicas
            self._configs[replicas] = config
        return self._configs[replicas]

    def _live(self) -> None:
        if self._closed:
            raise ClosedError("MooncakeStoreAdapter is closed")

    def _span(self, offset: int, size: int) -> None:
        self._live()
        if offset < 0 or size <= 0 or offset + size > self.buffer_bytes:
            raise OutOfBounds(f"[{offset}, {offset}+{size}) outside the {self.buffer_bytes}-byte buffer")

    def put_from(self, key: str, offset: int, size: int, replicas: int) -> None:
        """Store `src[offset:offset+size]` under `key` with `replicas` copies. Raises RuntimeError."""
        self._span(offset, size)
        rc = self._store.put_from(key, self._src_addr + offset, size, self._config(replicas))
        _check(rc, f"put_from({key!r}, {size} B, replicas={replicas})")

    def batch_put_from(self, keys: list[str], offsets: list[int], size: int, replicas: int) -> None:
        """Store `src[offsets[i]:offsets[i]+size]` under `keys[i]`. Raises RuntimeError on any failure."""
        for offset in offsets:
            self._span(offset, size)
        ptrs = [self._src_addr + offset for offset in offsets]
        rcs = self._store.batch_put_from(keys, ptrs, [size] * len(keys), self._config(replicas))
        for key, rc in zip(keys, rcs, strict=True):
            _check(rc, f"batch_put_from: {key!r} ({size} B, replicas={replicas})")

    def get_into(self, key: str, offset: int, size: int) -> int:
        """Read `key` into `dst[offset:offset+size]`; returns bytes read. Raises RuntimeError."""
        self._span(offset, size)
        nbytes = self._store.get_into(key, self._dst_addr + offset, size)
        _check(min(nbytes, 0), f"get_into({key!r}, {size} B)")
        return nbytes

    def batch_get_into(self, keys: list[str], offsets: list[int], size: int) -> list[int]:
        """Read `keys[i]` into `dst[offsets[i]:...]`; returns bytes read per key. Raises RuntimeError."""
        for offset in offsets:
            self._span(offset, size)
        ptrs = [self._dst_addr + offset for offset in offsets]
        results = self._store.batch_get_into(keys, ptrs, [size] * len(keys))
        for key, nbytes in zip(keys, results, strict=True):
            _check(min(nbytes, 0), f"batch_get_into: {key!r} ({size} B)")
        return list(results)

    def exists(self, key: str) -> bool:
        """Whether `key` is stored. Raises RuntimeError on an error code."""
        self._live()
        rc = self._store.is_exist(key)
        _check(min(rc, 0), f"is_exist({key!r})")
        return rc == 1

    def num_replicas(self, key: str) -> int:
        """How many replicas the master lists for `key` (0 when absent)."""
        self._live()
        return len(self._store.get_replica_desc(key))

    def on_disk_only(self, key: str) -> bool:
        """Whether `key` has replicas and none of them is in memory (offloaded, evicted)."""
        self._live()
        descs = self._store.get_replica_desc(key)
        return bool(descs) and not any(getattr(d, "is_memory_replica")() for d in descs)  # noqa: B009

    def remove(self, key: str) -> None:
        """Remove `key` (force=True: ignores leases). Raises RuntimeError, also when it is absent."""
        self._live()
        _check(self._store.remove(key, True), f"remove({key!r})")

    def remove_all(self) -> None:
        """Remove every object (force=True). Raises RuntimeError."""
        self._live()
        _check(min(self._store.remove_all(True), 0), "remove_all")

    def close(self) -> None:
        """Unregister the buffers and close the store. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for addr in self._registered:
            rc = self._store.unregister_buffer(addr)
            if rc != 0:
                logger.warning("unregister_buffer(%#x) returned %d", addr, rc)
        self._registered = []
        rc = self._store.close()
        if rc != 0:
            logger.warning("MooncakeDistributedStore.close() returned %d", rc)

    def __enter__(self) -> MooncakeStoreAdapter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"mooncake store {what} returned {rc}")


def _check_roundtrip(adapter: MooncakeStoreAdapter, size: int, replicas: int, rng: np.random.Generator) -> None:
    """Put one value and a batch of four, read them back, compare bytes, remove them."""
    key = f"selftest-{size}-{replicas}"
    adapter.src[:size] = rng.integers(0, 256, size, dtype=np.uint8)
    adapter.put_from(key, 0, size, replicas)
    if not adapter.exists(key) or adapter.num_replicas(key) != replicas:
        raise RuntimeError(f"{key}: exists={adapter.exists(key)}, replicas={adapter.num_replicas(key)}")
    if adapter.get_into(key, size, size) != size or not np.array_equal(
        adapter.dst[size : 2 * size], adapter.src[:size]
    ):
        raise RuntimeError(f"{key}: bytes read back differ")
    adapter.remove(key)
    if adapter.exists(key):
        raise RuntimeError(f"{key}: still there after remove")
    keys, offsets = [f"{key}-{i}" for i in range(4)], [i * size for i in range(4)]
    adapter.src[: 4 * size] = rng.integers(0, 256, 4 * size, dtype=np.uint8)
    adapter.batch_put_from(keys, offsets, size, replicas)
    if adapter.batch_get_into(keys, offsets, size) != [size] * 4:
        raise RuntimeError(f"{key}: batch_get_into short read")
    if not np.array_equal(adapter.dst[: 4 * size], adapter.src[: 4 * size]):
        raise RuntimeError(f"{key}: batch bytes read back differ")
    adapter.remove_all()


def _time_ops(adapter: MooncakeStoreAdapter, size: int, replicas: int, num_ops: int) -> tuple[float, float]:
    """Mean seconds per put_from and per get_into of `size` bytes over `num_ops` fresh keys."""
    clock = WallClock()
    put_s = get_s = 0.0
    for i in range(num_ops + 10):  # the first 10 are warm-up
        key = f"timed-{replicas}-{i}"
        start = clock.now()
        adapter.put_from(key, 0, size, replicas)
        mid = clock.now()
        adapter.get_into(key, 0, size)
        if i >= 10:
            put_s, get_s = put_s + mid - start, get_s + clock.now() - mid
    adapter.remove_all()
    return put_s / num_ops, get_s / num_ops


def _selftest(num_ops: int) -> None:
    out = protocol_stream()
    rng = np.random.default_rng(0)
    with MooncakeCluster(256 * MIB) as cluster, MooncakeStoreAdapter(cluster.master_addr, 16 * MIB) as adapter:
        for replicas in (1, 2):
            for size in (MIB, 4 << 10):
                _check_roundtrip(adapter, size, replicas, rng)
                out.write(f"ok: {size} B x replicas={replicas} (single and batch of 4, bytes verified)\n")
        for replicas in (1, 2):
            put_s, get_s = _time_ops(adapter, MIB, replicas, num_ops)
            out.write(
                f"1 MiB replicas={replicas}: put_from {put_s * 1e6:.0f} us, get_into {get_s * 1e6:.0f} us, "
                f"put+get {(put_s + get_s) * 1e6:.0f} us per op ({num_ops} ops)\n"
            )


def main(argv: list[str] | None = None) -> int:
    """`selftest [--num-ops N]`."""
    parser = argparse.ArgumentParser(prog="python -m tsukimi.bench.child mooncake-store")
    sub = parser.add_subparsers(dest="command", required=True)
    selftest = sub.add_parser("selftest", help="start a cluster, check round trips, time 1 MiB ops")
    selftest.add_argument("--num-ops", type=int, default=100)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if not mooncake_store_available():
        print("mooncake.store or mooncake_master is not installed", file=sys.stderr)
        return 1
    _selftest(args.num_ops)
    return 0
