"""The measuring client of `tsukimi bench store`: a process that mounts nothing and runs
timed put/get loops against tsukimi or the real Mooncake store, verifying every byte read.

    python -m tsukimi.bench.child store-client SYSTEM MASTER_ADDR BUFFER_BYTES [TRANSPORT]

Commands (line JSON): {"cmd": "measure", ...cell} -> figures; {"cmd": "measure_disk", ...}
-> get figures of objects that live only on disk (pushed there by filling memory);
{"cmd": "small_ops"} -> exists/remove p50. Both systems are driven through the same adapter
shape.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from tsukimi.clock import WallClock
from tsukimi.config import ClientConfig, Config, TransferConfig
from tsukimi.errors import OutOfSpace
from tsukimi.quantiles import quantile
from tsukimi.store.client import StoreClient
from tsukimi.testing.processes import child_reply


class StoreAdapter(Protocol):
    src: np.ndarray
    dst: np.ndarray

    def put_from(self, key: str, offset: int, size: int, replicas: int) -> None: ...
    def batch_put_from(self, keys: list[str], offsets: list[int], size: int, replicas: int) -> None: ...
    def get_into(self, key: str, offset: int, size: int) -> int: ...
    def batch_get_into(self, keys: list[str], offsets: list[int], size: int) -> list[int]: ...
    def exists(self, key: str) -> bool: ...
    def on_disk_only(self, key: str) -> bool: ...
    def remove(self, key: str) -> None: ...
    def remove_all(self) -> None: ...
    def close(self) -> None: ...


class TsukimiStoreAdapter:
    def __init__(self, master_addr: str, buffer_bytes: int, transport: str = "auto") -> None:
        cfg = replace(Config(), transfer=TransferConfig(transport=transport), client=ClientConfig(master=master_addr))
        self.client = StoreClient(cfg)
        self.src = np.zeros(buffer_bytes, np.uint8)
        self.dst = np.zeros(buffer_bytes, np.uint8)

    def put_from(self, key: str, offset: int, size: int, replicas: int) -> None:
        self.client.put(key, self.src[offset : offset + size], replicas=replicas)

    def batch_put_from(self, keys: list[str], offsets: list[int], size: int, replicas: int) -> None:
        errors = self.client.batch_put(
            [(k, self.src[o : o + size]) for k, o in zip(keys, offsets, strict=True)], replicas
        )
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]

    def get_into(self, key: str, offset: int, size: int) -> int:
        return self.client.get_into(key, self.dst[offset : offset + size]) or 0

    def batch_get_into(self, keys: list[str], offsets: list[int], size: int) -> list[int]:
        results = self.client.batch_get(keys, [self.dst[o : o + size] for o in offsets])
        return [r.size if r.error is None else -1 for r in results]

    def exists(self, key: str) -> bool:
        return self.client.exists(key)

    def on_disk_only(self, key: str) -> bool:
        info = self.client.describe([key])[0]
        return info is not None and not info.replicas and bool(info.disk_replicas)

    def remove(self, key: str) -> None:
        self.client.remove(key, force=True)

    def remove_all(self) -> None:
        self.client.remove_all(force=True)

    def close(self) -> None:
        self.client.close()


def measure(store: StoreAdapter, cmd: dict[str, Any]) -> dict[str, float]:
    """Put then get one cell for `duration_s` each; latencies per call; bytes verified."""
    clock = WallClock()
    size, batch, replicas, limit = cmd["value_bytes"], cmd["batch"], cmd["replicas"], cmd["max_stored_bytes"]
    rng = np.random.default_rng(size + batch + replicas)
    store.src[: size * batch] = rng.integers(0, 256, size * batch, dtype=np.uint8)
    offsets = [i * size for i in range(batch)]
    groups: list[list[str]] = []
    put_s: list[float] = []
    start = clock.now()
    # NOTE: stored bytes stay under `max_stored_bytes`, so gets read what is still resident
    while (not put_s or clock.now() - start < cmd["duration_s"]) and (len(groups) + 1) * batch * size <= limit:
        keys = [f"{cmd['prefix']}-{len(groups)}-{j}" for j in range(batch)]
        t0 = clock.now()
        if batch == 1:
            store.put_from(keys[0], 0, size, replicas)
        else:
            store.batch_put_from(keys, offsets, size, replicas)
        put_s.append(clock.now() - t0)
        groups.append(keys)
    get_s = _timed_gets(store, groups, size, cmd["duration_s"])
    store.remove_all()
    moved = size * batch
    return {
        "put_gbps": moved * len(put_s) / sum(put_s) / 1e9,
        "get_gbps": moved * len(get_s) / sum(get_s) / 1e9,
        "put_p50_us": _pct(put_s, 50),
        "put_p99_us": _pct(put_s, 99),
        "get_p50_us": _pct(get_s, 50),
        "get_p99_us": _pct(get_s, 99),
    }


def measure_disk(store: StoreAdapter, cmd: dict[str, Any]) -> dict[str, float]:
    """Put `target_bytes` of objects, push them out of memory onto disk by putting filler
    (at most `fill_bytes`), then get them for `duration_s`, every byte checked."""
    clock = WallClock()
    size, batch = cmd["value_bytes"], cmd["batch"]
    store.src[: size * batch] = np.random.default_rng(size + batch).integers(0, 256, size * batch, dtype=np.uint8)
    offsets = [i * size for i in range(batch)]
    groups = [
        [f"{cmd['prefix']}-t{g}-{j}" for j in range(batch)] for g in range(max(1, cmd["target_bytes"] // size // batch))
    ]
    for keys in groups:
        store.batch_put_from(keys, offsets, size, 1)
    filler, filled, n = min(len(store.src), max(size, 1 << 20)), 0, 0
    deadline = clock.now() + 60.0
    ends = (groups[0][0], groups[-1][-1])
    while not all(store.on_disk_only(k) for k in ends) or not all(store.on_disk_only(k) for g in groups for k in g):
        if clock.now() > deadline:
            raise RuntimeError(f"{cmd['prefix']}: the objects never left memory ({filled} bytes of filler)")
        if filled < cmd["fill_bytes"]:
            try:
                store.put_from(f"{cmd['prefix']}-fill{n}", 0, filler, 1)
                filled, n = filled + filler, n + 1
            except (RuntimeError, OutOfSpace):  # memory full, the system still evicting: wait
                clock.sleep(0.05)
        elif clock.now() > deadline:
            raise RuntimeError(f"{cmd['prefix']}: the objects never left memory ({filled} bytes of filler)")
        else:
            clock.sleep(0.05)
    get_s = _timed_gets(store, groups, size, cmd["duration_s"])
    stayed = all(store.on_disk_only(keys[0]) for keys in groups)
    store.remove_all()
    return {
        "get_gbps": size * batch * len(get_s) / sum(get_s) / 1e9,
        "get_p50_us": _pct(get_s, 50),
        "get_p99_us": _pct(get_s, 99),
        "stayed_on_disk": float(stayed),
    }


def _timed_gets(store: StoreAdapter, groups: list[list[str]], size: int, duration_s: float) -> list[float]:
    """Get the groups round-robin for `duration_s` (at least once), each call timed and its
    bytes checked against `store.src`. Raises RuntimeError on a short read or wrong bytes."""
    clock, batch = WallClock(), len(groups[0])
    offsets = [i * size for i in range(batch)]
    get_s: list[float] = []
    start, i = clock.now(), 0
    while not get_s or clock.now() - start < duration_s:
        keys = groups[i % len(groups)]
        store.dst[: size * batch] = 0
        t0 = clock.now()
        got = [store.get_into(keys[0], 0, size)] if batch == 1 else store.batch_get_into(keys, offsets, size)
        get_s.append(clock.now() - t0)
        if got != [size] * batch or not np.array_equal(store.dst[: size * batch], store.src[: size * batch]):
            raise RuntimeError(f"get of {keys[0]} returned {got[:3]}... or wrong bytes")
        i += 1
    return get_s


def small_ops(store: StoreAdapter, count: int = 200) -> dict[str, float]:
    clock = WallClock()
    keys = [f"small-{i}" for i in range(count)]
    for key in keys:
        store.put_from(key, 0, 64, 1)
    exists_s, remove_s = [], []
    for key in keys:
        t0 = clock.now()
        assert store.exists(key)
        exists_s.append(clock.now() - t0)
    for key in keys:
        t0 = clock.now()
        store.remove(key)
        remove_s.append(clock.now() - t0)
    return {"exists_p50_us": _pct(exists_s, 50), "remove_p50_us": _pct(remove_s, 50)}


def _pct(samples: list[float], pct: int) -> float:
    """The `pct`th percentile of `samples` in microseconds (tsukimi/quantiles.py)."""
    return quantile(samples, pct / 100) * 1e6


def main(argv: list[str]) -> None:
    """Serve the commands on stdin for SYSTEM (tsukimi or mooncake) until stdin closes."""
    system, master, buffer_bytes = argv[0], argv[1], int(argv[2])
    protocol_out = sys.stdout
    if system == "mooncake":
        from tsukimi.bench.mooncake_store import MooncakeStoreAdapter

        # NOTE: the C++ library prints to fd 1: keep a private copy of it for our replies.
        protocol_out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        store: StoreAdapter = MooncakeStoreAdapter(master, buffer_bytes)
    else:
        store = TsukimiStoreAdapter(master, buffer_bytes, argv[3] if len(argv) > 3 else "auto")
    child_reply({}, protocol_out)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                run = {"small_ops": lambda c: small_ops(store), "measure_disk": lambda c: measure_disk(store, c)}
                figures = run.get(cmd["cmd"], lambda c: measure(store, c))(cmd)
                child_reply(figures, protocol_out)
            except Exception as exc:  # reported to the driver, which raises it there
                child_reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"}, protocol_out)
    finally:
        store.close()
