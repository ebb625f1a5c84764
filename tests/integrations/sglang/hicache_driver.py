"""Run inside `.venv-sglang` under `tsukimi compat exec` by test_hicache.py (not a test module
itself): SGLang's HiCache Mooncake backend, `MooncakeStore`, on real SGLang host pools
(`MHATokenToKVPoolHost` page_first, `MLATokenToKVPoolHost` layer_first: both build on CPU),
against a `tsukimi compat mooncake-master`. Writes what the test compares as JSON.

    python hicache_driver.py '{"master_http": "http://127.0.0.1:PORT", "out": "result.json"}'

The Mooncake settings come from the environment, as SGLang reads them (MOONCAKE_MASTER, ...).
Groups, in order (one process: SGLang's imports take most of its time):
- "v1": batch_set_v1 / batch_exists / batch_get_v1 at MHA TP 1, 4, 8 and MLA TP 1, 8 (one
  MooncakeStore per TP rank); pages filled with distinct bytes, the pool zeroed, read back.
- "v2": the pool-aware calls with a registered DRAFT pool (MHA: K and V objects; MLA
  layer_first: one object per page, one buffer per layer).
- "groups": `enable_group_semantics` (ReplicateConfig.group_ids per object).
- "shared_engine": issue 25 item A: SGLANG_HICACHE_MOONCAKE_REUSE_TE with protocol rdma (tcp
  here, with one warning, without NIXL) after `init_mooncake_transfer_engine`, with
  MOONCAKE_CHECK_SERVER polling the master's /get_all_segments.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import urllib.request
import uuid

import torch

PAGE = 4  # tokens per page
PAGES = 6  # pages per batch
LAYERS = 3
HEADS, HEAD_DIM = 2, 16  # MHA: a K page per rank is LAYERS * PAGE * HEADS * HEAD_DIM floats
KV_LORA, ROPE = 24, 8  # MLA row width KV_LORA + ROPE


class Counter(logging.Handler):
    """Counts log records whose message contains one of `needles`."""

    def __init__(self, *needles: str) -> None:
        super().__init__(logging.DEBUG)
        self.counts = dict.fromkeys(needles, 0)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for needle in self.counts:
            if needle in message:
                self.counts[needle] += 1


def all_keys(master_http: str) -> set[str]:
    keys: set[str] = set()
    after = ""
    while True:
        url = master_http + "/get_all_keys" + (f"?start_after={after}" if after else "")
        with urllib.request.urlopen(url, timeout=10) as reply:
            keys.update(reply.read().decode().split())
            after = reply.headers.get("X-Next-Start-After") or ""
        if not after:
            return keys


def segments(master_http: str) -> list[str]:
    with urllib.request.urlopen(master_http + "/get_all_segments", timeout=10) as reply:
        return reply.read().decode().split()


def mha_pool(seed_tokens: int = 64):
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(seed_tokens, HEADS, HEAD_DIM) for _ in range(LAYERS))
    v = tuple(torch.zeros(seed_tokens, HEADS, HEAD_DIM) for _ in range(LAYERS))
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=ptr_table(k), v_data_ptrs=ptr_table(v), layout=KVBufferLayout.NHD)
    info = MHABufferInfo(
        buffers=buffers,
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=seed_tokens,
        start_layer=0,
        end_layer=LAYERS,
    )


def mla_pool(seed_tokens: int = 64):
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    rows = tuple(torch.zeros(seed_tokens, 1, KV_LORA + ROPE) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=ptr_table(rows),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=PAGE,
        kv_lora_rank=KV_LORA,
        qk_rope_head_dim=ROPE,
        kv_cache_dim=KV_LORA + ROPE,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        "layer_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=seed_tokens,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )


def ptr_table(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def storage_config(tp_rank: int, tp_size: int, mla: bool, extra: dict | None = None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=not mla,
        model_name=None,
        extra_config=extra,
    )


def fill(pool, seed: int) -> bytes:
    """Distinct random bytes in the whole host pool; what it now holds."""
    view = pool.kv_buffer.view(torch.uint8).view(-1)
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return pool_bytes(pool)


def pool_bytes(pool) -> bytes:
    return pool.kv_buffer.view(torch.uint8).numpy().tobytes()


def page_tokens(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def round_trip_v1(store, pool, keys: list[str], first_page: int, seed: int) -> dict[str, object]:
    """batch_set_v1 the pages, zero the pool, batch_get_v1 them back: the answers and whether
    the pages' bytes came back exactly (the rest of the pool stays zero)."""
    indices = page_tokens(first_page, len(keys))
    fill(pool, seed)
    expected = pool.kv_buffer.clone()
    set_ok = store.batch_set_v1(keys, indices)
    exists = store.batch_exists(keys)
    exists_gap = store.batch_exists([*keys[:2], "missing-" + uuid.uuid4().hex, *keys[2:]])
    pool.kv_buffer.zero_()
    get_ok = store.batch_get_v1(keys, indices)
    got = pool.kv_buffer
    mask = torch.zeros(pool.size, dtype=torch.bool)
    mask[indices] = True
    return {
        "set": set_ok,
        "exists": exists,
        "exists_with_gap_at_2": exists_gap,
        "get": get_ok,
        **compare(expected, got, mask),
    }


def compare(expected: torch.Tensor, got: torch.Tensor, mask: torch.Tensor) -> dict[str, object]:
    """The pages' bytes equal, the other tokens' bytes zero, and how many bytes were compared.
    Both layouts here keep tokens on axis 1: MHA page_first [2, token, layer, head, dim], MLA
    layer_first [layer, token, 1, width]."""
    pages, rest = (slice(None), mask), (slice(None), ~mask)
    equal = torch.equal(expected[pages].view(torch.uint8), got[pages].view(torch.uint8))
    rest_zero = not got[rest].view(torch.uint8).any().item()
    return {"bytes_equal": equal, "rest_zero": rest_zero, "bytes_compared": got[pages].nbytes}


def tp_group(master_http: str, mla: bool, tp_size: int, seed: int) -> tuple[dict[str, object], list]:
    """One MooncakeStore per TP rank, each on its own host pool, the same page keys; each rank's
    round trip, and the keys the master holds for those pages against SGLang's layout."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    stores, pools = [], []
    for rank in range(tp_size):
        pool = mla_pool() if mla else mha_pool()
        store = MooncakeStore(storage_config(rank, tp_size, mla), mem_pool=pool)
        store.register_mem_pool_host(pool)
        stores.append(store)
        pools.append(pool)
    keys = [uuid.uuid4().hex for _ in range(PAGES)]
    # NOTE: MLA ranks hold the same KV (one object per page for all ranks): the same bytes
    ranks = [
        round_trip_v1(store, pool, keys, first_page=2, seed=seed if mla else seed + rank)
        for rank, (store, pool) in enumerate(zip(stores, pools, strict=True))
    ]
    expected = (
        {f"{key}__k" for key in keys}
        if mla
        else {f"{key}_{rank}_{kv}" for key in keys for rank in range(tp_size) for kv in "kv"}
    )
    held = {key for key in all_keys(master_http) if key.split("_")[0] in keys}
    return {"ranks": ranks, "keys_expected": sorted(expected), "keys_held": sorted(held)}, stores


def v2_group(store, draft, master_http: str, mla: bool, seed: int) -> dict[str, object]:
    """The pool-aware calls on a registered DRAFT pool (KV pages set first: batch_exists_v2
    counts the KV prefix), with a session id on the set."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName, PoolTransfer

    store.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    keys = [uuid.uuid4().hex for _ in range(PAGES)]
    indices = page_tokens(1, PAGES)
    kv_set = store.batch_set_v1(keys, indices)
    fill(draft, seed)
    expected = draft.kv_buffer.clone()
    info = HiCacheStorageExtraInfo(extra_info={"session_id": "sgltests-session"})
    set_ok = store.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=indices, keys=keys)], info)
    exists = store.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT, keys=keys)])
    missing = store.batch_exists_v2([*keys[:3], uuid.uuid4().hex], [PoolTransfer(name=PoolName.DRAFT)])
    draft.kv_buffer.zero_()
    get_ok = store.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=indices, keys=keys)])
    mask = torch.zeros(draft.size, dtype=torch.bool)
    mask[indices] = True
    suffixes = [f"__{PoolName.DRAFT}_k"] if mla else [f"_0_{PoolName.DRAFT}_k", f"_0_{PoolName.DRAFT}_v"]
    held = {key for key in all_keys(master_http) if key.split("_")[0] in keys}
    return {
        "kv_set": kv_set,
        "set": {str(name): value for name, value in set_ok.items()},
        "get": {str(name): value for name, value in get_ok.items()},
        "exists": {
            "kv_hit_pages": exists.kv_hit_pages,
            "extra_pool_hit_pages": {str(k): v for k, v in exists.extra_pool_hit_pages.items()},
            "restorable_prefix_pages": exists.restorable_prefix_pages,
        },
        "exists_missing_at_3": missing.kv_hit_pages,
        "draft_keys_expected": sorted(f"{key}{suffix}" for key in keys for suffix in suffixes),
        "keys_held": sorted(held),
        "buffers_per_page": len(draft.get_page_buffer_meta(page_tokens(0, 1))[0]),
        **compare(expected, draft.kv_buffer, mask),
    }


def main() -> None:
    args = json.loads(sys.argv[1])
    master_http = args["master_http"]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    counter = Counter("protocol rdma: NIXL is not installed", "Reuse initialized mooncake transfer engine")
    logging.getLogger().addHandler(counter)

    import mooncake.store
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    result: dict[str, object] = {"store_module": mooncake.store.MooncakeDistributedStore.__module__}
    keep = []  # the first stores stay up: MOONCAKE_CHECK_SERVER below needs a mounted segment
    v1: dict[str, object] = {}
    groups = (("mha_tp1", False, 1), ("mla_tp1", True, 1), ("mha_tp4", False, 4), ("mha_tp8", False, 8))
    for name, mla, tp_size in (*groups, ("mla_tp8", True, 8)):
        v1[name], stores = tp_group(master_http, mla, tp_size, seed=len(v1) * 100)
        if tp_size == 1:
            keep.append(stores[0])
        else:
            for store in stores:
                store.store.close()
    result["v1"] = v1
    result["v2"] = {
        "mha": v2_group(keep[0], mha_pool(), master_http, mla=False, seed=7),
        "mla": v2_group(keep[1], mla_pool(), master_http, mla=True, seed=8),
    }

    grouped_pool = mha_pool()
    grouped = MooncakeStore(storage_config(0, 1, False, {"enable_group_semantics": True}), mem_pool=grouped_pool)
    grouped.register_mem_pool_host(grouped_pool)
    result["groups"] = {
        "use_group_semantics": grouped._use_group_semantics,
        **round_trip_v1(grouped, grouped_pool, [uuid.uuid4().hex for _ in range(PAGES)], 0, seed=9),
    }
    grouped.store.close()

    # Issue 25 item A (and D): SGLang's ModelRunner builds the shared engine first
    os.environ.update(
        SGLANG_HICACHE_MOONCAKE_REUSE_TE="1",
        MOONCAKE_PROTOCOL="rdma",
        MOONCAKE_DEVICE="mlx5_0",
        MOONCAKE_CHECK_SERVER="1",
    )
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

    engine = init_mooncake_transfer_engine("127.0.0.1", gpu_id=0, ib_device="mlx5_0")
    segments_before = segments(master_http)
    shared_pool = mha_pool()
    shared = MooncakeStore(storage_config(0, 1, False), mem_pool=shared_pool)
    shared.register_mem_pool_host(shared_pool)
    result["shared_engine"] = {
        "segments_before": segments_before,
        "session_id": engine.get_session_id(),
        "store_hostname": shared.store.get_hostname(),
        "engine_type": type(engine.get_engine()).__module__ + "." + type(engine.get_engine()).__name__,
        "segments_after": segments(master_http),
        **round_trip_v1(shared, shared_pool, [uuid.uuid4().hex], 0, seed=10),
    }
    result["log_counts"] = counter.counts
    with open(args["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
