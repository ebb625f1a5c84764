"""The workload of Mooncake's test_ssd_offload_in_evict.py, scaled down and checked: one
holder with a disk, the memory tier overflowed three times over by puts of random values,
then every key read back byte-exact (the Mooncake file never checks its reads). No put
fails: one that finds memory full of objects still on their way to disk waits for them
(OffloadPending, `client.put_wait_s`), and nothing is ever dropped."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tsukimi.config import ClientConfig, Config
from tsukimi.netio import free_port
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.deployments import MASTER

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20
SEGMENT = 16 * MIB
VALUE = 256 << 10


def test_every_read_after_overflowing_memory_three_times_is_byte_exact(tmp_path: Path) -> None:
    master = MasterServer(replace(MASTER, rpc_port=free_port(), http_port=free_port(), put_timeout_s=5.0))
    endpoint = f"tcp://127.0.0.1:{master.rpc.port}"
    cfg = ClientConfig(master=endpoint, segment_bytes=SEGMENT, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=256 * MIB)
    holder = StoreClient(replace(Config(), client=cfg))  # writer and holder, as in the Mooncake file
    reader = StoreClient(replace(Config(), client=ClientConfig(master=endpoint)))
    try:
        values = {f"k_{i}": os.urandom(VALUE) for i in range(3 * SEGMENT // VALUE)}
        for key, value in values.items():
            holder.put(key, value)
        state = master.state
        assert state.counters["evictions"] == 0 and state.counters["objects_lost"] == 0, state.counters
        assert state.counters["offloaded_bytes"] >= 2 * SEGMENT
        on_disk_only = sum(1 for r in state.objects.values() if not r.replicas)
        assert len(state.objects) == len(values) and on_disk_only >= len(values) // 2
        for key, value in values.items():  # one by one, from another client
            assert reader.get(key) == value, key
        buffers = [bytearray(VALUE) for _ in range(4)]
        keys = list(values)
        for start in range(0, len(keys), 4):  # batched, into buffers, from the holder itself
            batch = keys[start : start + 4]
            results = holder.batch_get(batch, buffers[: len(batch)])
            assert [bytes(r.value() or b"") for r in results] == [values[k] for k in batch]
        assert reader.disk_reads + holder.disk_reads >= on_disk_only
    finally:
        reader.close()
        holder.close()
        master.close()
