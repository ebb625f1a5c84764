"""tsukimi's store row of `tsukimi bench gpu`: the pool filling a paged GPU cache.

A master and one holder process (`TsukimiCluster`); this process seeds the pool with
`num_blocks` blocks of `block_bytes` (tsukimi/store/paged.py `put_blocks`), then times
`get_blocks` filling a `[num_blocks, block_bytes]` uint8 cache in a shuffled block order: the
holder's shared memory -> this client's pinned staging (the shm transport, one batch) -> ONE
host->GPU copy -> ONE scatter kernel (tsukimi/store/device_io.py). Figures:
`tsukimi.store_kv_blocks_gbps` (best of `repeats`, every byte checked once) and the path taken.
Without CUDA the cache is a CPU tensor (the store's host path): a CI check, not a GPU figure.
"""

from __future__ import annotations

import random
import time
import uuid

import torch

from tsukimi.errors import TsukimiError
from tsukimi.store.client import StoreClient
from tsukimi.store.paged import get_blocks, put_blocks
from tsukimi.testing.deployments import TsukimiCluster

Figure = float | str


def store_rows(device: str, num_blocks: int, block_bytes: int, repeats: int) -> dict[str, Figure]:
    """The paged-cache fill (see the module).

    Raises:
        RuntimeError: a put or a fill failed, or the cache did not get the pool's bytes.
    """
    total = num_blocks * block_bytes
    source = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, device=device)
    order = list(range(num_blocks))
    random.Random(num_blocks).shuffle(order)
    keys = [f"bench-gpu-{uuid.uuid4().hex[:8]}-{i}" for i in range(num_blocks)]
    with TsukimiCluster(total + (64 << 20), num_holders=1) as cluster:
        client = StoreClient.connect(cluster.master_addr)
        try:
            _synchronize(device)
            errors = [e for e in put_blocks(client, keys, source, range(num_blocks)) if e is not None]
            if errors:
                raise RuntimeError(f"{len(errors)} blocks were not stored: {errors[0]}")
            cache = torch.zeros_like(source)
            best = float("inf")
            for _ in range(repeats + 1):  # NOTE: the first is the warm-up (staging, pinning)
                _synchronize(device)
                start = time.perf_counter()
                failed = get_blocks(client, keys, cache, order)
                _synchronize(device)
                best = min(best, time.perf_counter() - start)
                if failed:
                    raise RuntimeError(f"{len(failed)} blocks were not filled")
            if not torch.equal(cache[order], source):
                raise RuntimeError("the paged cache does not hold the pool's blocks")
        except TsukimiError as exc:
            raise RuntimeError(f"the store row failed: {exc}") from exc
        finally:
            client.close()
    return {
        "tsukimi.store_kv_blocks_gbps": round(total / best / 1e9, 3),
        "tsukimi.store_kv_blocks_s": round(best, 5),
        "tsukimi.store_kv_blocks_path": "device (staged, one copy, one scatter)" if device != "cpu" else "host",
    }


def _synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()
