"""KV blocks of a paged cache to and from the pool: one object per block, raw bytes (no header).

A paged cache is a tensor `[num_blocks, *block_shape]` on any device whose blocks are contiguous
(vLLM's per-layer layout; tsukimi's engine's). On a GPU the store stages the whole batch
(device_io.py): a put is one gather kernel and one GPU->host copy, a get one host->GPU copy and
one scatter kernel, whatever the number of blocks.

    put_blocks(client, keys, cache, block_ids)       block_ids[i] stored under keys[i]
    failed = get_blocks(client, keys, cache, ids)     the block ids not filled (misses, errors)

`tsukimi bench gpu` times `get_blocks` filling a [4096, 32 KiB] uint8 CUDA cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tsukimi.errors import InvalidArgument, TsukimiError
from tsukimi.store.client import StoreClient


def _blocks(cache: torch.Tensor, keys: Sequence[str], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Views of `cache`'s blocks. Raises InvalidArgument: counts that differ, a block out of
    range, or blocks that are not contiguous."""
    if len(keys) != len(block_ids):
        raise InvalidArgument(f"{len(keys)} keys but {len(block_ids)} block ids")
    if cache.dim() < 1 or not cache[0].is_contiguous():
        raise InvalidArgument(f"a paged cache is [blocks, ...] with contiguous blocks, got {tuple(cache.shape)}")
    num_blocks = cache.shape[0]
    if any(not 0 <= b < num_blocks for b in block_ids):
        raise InvalidArgument(f"a block id outside [0, {num_blocks})")
    return [cache[b] for b in block_ids]


def put_blocks(
    client: StoreClient, keys: Sequence[str], cache: torch.Tensor, block_ids: Sequence[int]
) -> list[TsukimiError | None]:
    """Store block `block_ids[i]` of `cache` under `keys[i]`, in one batch (a GPU cache: the
    caller's writes to it are complete, e.g. `torch.cuda.synchronize()`). Mutates the store.

    Returns:
        Each key's error or None (ObjectExists where it was stored already).
    Raises:
        InvalidArgument (see `_blocks`); RpcTimeout / MasterUnavailable; DeviceError.
    """
    return client.batch_put(list(zip(keys, _blocks(cache, keys, block_ids), strict=True)))


def get_blocks(client: StoreClient, keys: Sequence[str], cache: torch.Tensor, block_ids: Sequence[int]) -> set[int]:
    """Fill block `block_ids[i]` of `cache` from `keys[i]`, in one batch. Mutates the blocks
    read, and only those.

    Returns:
        The block ids not filled: a miss, an object of another size, a failed read.
    Raises:
        InvalidArgument (see `_blocks`); RpcTimeout / MasterUnavailable; DeviceError.
    """
    views = _blocks(cache, keys, block_ids)
    want = views[0].numel() * views[0].element_size() if views else 0
    results = client.batch_get(keys, views)
    return {b for b, r in zip(block_ids, results, strict=True) if r.error is not None or r.size != want}
