"""How many KV blocks a worker's cache gets: an explicit count, or its memory budget over the
model's bytes per block (vLLM sizes its KV cache from a memory budget the same way).

    bytes per block = layers x (K and V: 2) x block_tokens x KV heads x head dim x dtype bytes
                      (+ a 64-byte trailer per layer: tsukimi/engine/kv_cache.py `slot_bytes`)
    blocks          = budget bytes // bytes per block      (at least 1)

A fractional budget is a share of the memory available now (MemAvailable in /proc/meminfo,
else the physical memory; on a GPU, its free memory after the model loaded). The decode
workers report the result (GET /load total_blocks) and the router gives each decode instance
its own capacity in the Conductor.
"""

from __future__ import annotations

import logging
import os

import torch

from tsukimi.config import WorkerConfig
from tsukimi.config.memory import MemoryBudget
from tsukimi.engine.device import CPU
from tsukimi.engine.kv_cache import KVLayout

logger = logging.getLogger(__name__)


def block_bytes(layout: KVLayout) -> int:
    """The memory one KV block of `layout` takes in the cache, trailers included (pure)."""
    return layout.num_layers * layout.slot_bytes


def available_memory_bytes() -> int:
    """The memory available to new allocations now (MemAvailable; else physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_device_bytes(device: torch.device) -> int:
    """The memory free for new allocations on `device` now (the host's for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory_bytes()


def kv_cache_blocks(
    config: WorkerConfig,
    layout: KVLayout,
    available_bytes: int | None = None,
    device: torch.device = CPU,
) -> int:
    """The worker's KV cache size in blocks: `config.num_blocks` when set, else
    `config.kv_cache_memory` over `block_bytes(layout)` (at least 1). Pure when
    `available_bytes` is given (else reads the memory available on `device` for a fractional
    budget)."""
    if config.num_blocks > 0:
        return config.num_blocks
    budget = MemoryBudget.parse(config.kv_cache_memory)
    if budget.fraction and available_bytes is None:
        available_bytes = available_device_bytes(device)
    blocks = max(1, budget.bytes_of(available_bytes or 0) // block_bytes(layout))
    logger.info(
        "KV cache of %s: %d blocks of %d bytes (%d tokens)",
        config.kv_cache_memory,
        blocks,
        block_bytes(layout),
        blocks * layout.block_tokens,
    )
    return blocks
