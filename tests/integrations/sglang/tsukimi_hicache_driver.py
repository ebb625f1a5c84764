"""Run inside `.venv-sglang` by test_hicache_backend.py (not a test module itself): loads
tsukimi's HiCache backend through SGLang's own `StorageBackendFactory.create_backend("dynamic",
...)` against a tsukimi master and runs the scenarios, printing one JSON object of checks
(name -> bool or value) for the test to assert on.

    python tsukimi_hicache_driver.py tcp://127.0.0.1:PORT

Host pools are SGLang's own classes (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`) with
only the fields their `get_page_buffer_meta` reads set, so the pointers the backend uses are
the ones SGLang computes. Each scenario writes random pages from one slot range and reads
them back into another, zeroed first, then compares the bytes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE = 4  # tokens per page
PAGES = 8  # pages each scenario writes (the pool holds 2x: written slots, then read slots)
LAYERS, HEADS, DIM = 3, 2, 16


def mha_pool() -> Any:
    pool = object.__new__(MHATokenToKVPoolHost)
    size = 2 * PAGES * PAGE
    pool.kv_buffer = torch.zeros(2, size, LAYERS, HEADS, DIM, dtype=torch.bfloat16)
    pool.page_size, pool.size, pool.layer_num, pool.head_num, pool.head_dim = PAGE, size, LAYERS, HEADS, DIM
    pool.dtype, pool.layout, pool.device, pool.pin_memory = torch.bfloat16, "page_first", "cpu", False
    return pool


def mla_pool() -> Any:
    pool = object.__new__(MLATokenToKVPoolHost)
    size = 2 * PAGES * PAGE
    pool.kv_buffer = torch.zeros(LAYERS, size, 1, DIM, dtype=torch.bfloat16)
    pool.page_size, pool.size, pool.layer_num, pool.kv_cache_dim = PAGE, size, LAYERS, DIM
    pool.dtype, pool.layout, pool.dcp_size = torch.bfloat16, "layer_first", 1
    return pool


def backend(master: str, pool: Any, tp_rank: int, tp_size: int, mla: bool = False) -> Any:
    extra = {
        "backend_name": "tsukimi",
        "module_path": "tsukimi.integrations.sglang.hicache",
        "class_name": "TsukimiHiCacheStorage",
        "interface_v1": 1,
        "master": master,
        "segment_bytes": 8 << 20,
        "rpc_timeout_s": 2.0,
    }
    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=not mla,
        model_name="test/model",
        extra_config=extra,
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def slots(first_page: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + PAGES) * PAGE, dtype=torch.int64)


def pages_of(pool: Any, first_page: int) -> bytes:
    """The bytes of the PAGES pages from `first_page` on, as the pool holds them."""
    # NOTE: token slots are dim 1 of both layouts (MHA [k|v, token, ...], MLA [layer, token, ...])
    rows = pool.kv_buffer[:, first_page * PAGE : (first_page + PAGES) * PAGE]
    return rows.contiguous().view(torch.uint8).numpy().tobytes()


def fill(pool: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def round_trip(storage: Any, pool: Any, keys: list[str]) -> dict[str, Any]:
    """Write pages 0.. from the pool, read them into pages PAGES.., compare."""
    wrote = storage.batch_set_v1(keys, slots(0))
    again = storage.batch_set_v1(keys, slots(0))
    exists = storage.batch_exists([*keys, "missing-page"])
    pool.kv_buffer.view(torch.uint8)[:, PAGES * PAGE :].zero_()
    read = storage.batch_get_v1(keys, slots(PAGES))
    return {
        "set": all(wrote),
        "set_again": all(again),
        "exists": exists,
        "get": all(read),
        "equal": pages_of(pool, 0) == pages_of(pool, PAGES),
    }


def scenario_tp(master: str, tp_size: int) -> dict[str, Any]:
    pools = [mha_pool() for _ in range(tp_size)]
    ranks = [backend(master, pools[r], r, tp_size) for r in range(tp_size)]
    keys = [f"tp{tp_size}-page-{i}" for i in range(PAGES)]
    for r, pool in enumerate(pools):
        fill(pool, seed=100 * tp_size + r)
    results = [round_trip(s, p, keys) for s, p in zip(ranks, pools, strict=True)]
    distinct = len({pages_of(p, 0) for p in pools}) == tp_size
    local = [
        all(info is not None and info.replicas[0].te_segment == s._client.engine.name for info in infos)
        for s in ranks
        for infos in [s._client.describe(s.keys.page_objects(keys, ""))]
    ]
    stats = ranks[0].get_stats()
    for s in ranks:
        s.close()
    return {"ranks": results, "distinct": distinct, "backup_pages": sum(stats.backup_pgs), "local": local}


def scenario_mla(master: str) -> dict[str, Any]:
    pools = [mla_pool(), mla_pool()]
    ranks = [backend(master, pools[r], r, 2, mla=True) for r in range(2)]
    keys = [f"mla-page-{i}" for i in range(PAGES)]
    fill(pools[0], seed=7)
    first = round_trip(ranks[0], pools[0], keys)
    seen = ranks[1].batch_exists(keys)
    got = ranks[1].batch_get_v1(keys, slots(PAGES))
    shared = pages_of(pools[1], PAGES) == pages_of(pools[0], 0)
    for s in ranks:
        s.close()
    return {"rank0": first, "rank1_exists": seen, "rank1_get": all(got), "rank1_equal": shared}


def generic_path(storage: Any, pool: Any) -> dict[str, Any]:
    """What SGLang's cache controller does without "interface_v1": one flat tensor per page
    through batch_set / batch_get (its _generic_page_set / _generic_page_get)."""
    keys = [f"flat-page-{i}" for i in range(PAGES)]
    stored = storage.batch_set(keys, [pool.get_data_page(i * PAGE) for i in range(PAGES)])
    pages = storage.batch_get([*keys, "flat-missing"], [pool.get_dummy_flat_data_page() for _ in range(PAGES + 1)])
    pool.kv_buffer.view(torch.uint8)[:, PAGES * PAGE :].zero_()
    for i, page in enumerate(pages[:PAGES]):
        pool.set_from_flat_data_page((PAGES + i) * PAGE, page)
    equal = pages_of(pool, 0) == pages_of(pool, PAGES)
    return {"generic_set": stored, "generic_miss": pages[-1] is None, "generic_equal": equal}


def scenario_misc(master: str) -> dict[str, Any]:
    """Misses, the legacy (pointer, size) calls, the v2 calls with a side pool, clear."""
    pool, side = mha_pool(), mha_pool()
    storage = backend(master, pool, 0, 1)
    storage.register_mem_host_pool_v2(side, PoolName.SWA)
    fill(pool, seed=1)
    fill(side, seed=2)
    out: dict[str, Any] = {"type": type(storage).__name__}
    out["miss_get"] = storage.batch_get_v1(["absent-0", "absent-1"], slots(0)[: 2 * PAGE])
    out["miss_exists"] = storage.batch_exists(["absent-0"])
    out["bad_indices"] = storage.batch_set_v1(["odd"], torch.arange(3))  # NOTE: not a page: False, no raise
    src = bytes(range(256)) * 4
    buf = bytearray(src)
    dst = bytearray(len(src))
    addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    dst_addr = torch.frombuffer(dst, dtype=torch.uint8).data_ptr()
    out["legacy_set"] = storage.set("legacy", target_location=addr, target_sizes=len(src))
    out["legacy_exists"] = storage.exists("legacy")
    out["legacy_get"] = storage.get("legacy", dst_addr, len(dst))
    out["legacy_equal"] = bytes(dst) == src
    out["legacy_batch_set"] = storage.batch_set(["l1", "l2"], target_locations=[addr, addr], target_sizes=[8, 8])
    out["legacy_batch_get"] = storage.batch_get(["l1", "l2", "l3"], [dst_addr] * 3, [8] * 3)
    out.update(generic_path(storage, pool))
    keys = [f"v2-page-{i}" for i in range(PAGES)]
    transfers = [PoolTransfer(PoolName.KV, slots(0), keys=keys), PoolTransfer(PoolName.SWA, slots(0), keys=keys)]
    out["v2_set"] = {str(k): all(v) for k, v in storage.batch_set_v2(transfers).items()}
    hit = storage.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys[-2:], hit_policy="trailing_pages")])
    out["v2_exists"] = hit.kv_hit_pages
    pool.kv_buffer.view(torch.uint8)[:, PAGES * PAGE :].zero_()
    side.kv_buffer.view(torch.uint8)[:, PAGES * PAGE :].zero_()
    back = [PoolTransfer(PoolName.KV, slots(PAGES), keys=keys), PoolTransfer(PoolName.SWA, slots(PAGES), keys=keys)]
    out["v2_get"] = {str(k): all(v) for k, v in storage.batch_get_v2(back).items()}
    out["v2_equal"] = pages_of(pool, 0) == pages_of(pool, PAGES) and pages_of(side, 0) == pages_of(side, PAGES)
    out["clear"] = storage.clear()
    out["after_clear"] = storage.batch_exists(keys)
    storage.close()
    # NOTE: a dead client: every call answers its failure value, nothing raises into SGLang
    out["closed"] = [
        storage.batch_set_v1(keys[:2], slots(0)[: 2 * PAGE]),
        storage.batch_exists(keys),
        storage.exists("x"),
    ]
    return out


def main() -> None:
    master = sys.argv[1]
    result = {
        "tp1": scenario_tp(master, 1),
        "tp4": scenario_tp(master, 4),
        "mla": scenario_mla(master),
        "misc": scenario_misc(master),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
