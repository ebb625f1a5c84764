"""KV cache sizing from a memory budget (tsukimi/engine/kv_budget.py, tsukimi/config/memory.py):
the blocks are the budget over the model's bytes per block; num_blocks overrides it."""

from __future__ import annotations

import pytest
import torch

from tsukimi.config import WorkerConfig
from tsukimi.config.memory import MemoryBudget
from tsukimi.engine.kv_budget import block_bytes, kv_cache_blocks
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.errors import ConfigError

TINY = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_tokens=16, dtype=torch.float32)


@pytest.mark.parametrize(
    ("text", "budget"),
    [
        ("512MiB", MemoryBudget(512 << 20)),
        ("1G", MemoryBudget(1 << 30)),
        ("1.5gb", MemoryBudget(3 << 29)),
        ("268435456", MemoryBudget(268435456)),
        ("0.1", MemoryBudget(fraction=0.1)),
        ("64 KiB", MemoryBudget(64 << 10)),
    ],
)
def test_budgets_parse_as_bytes_or_a_fraction(text: str, budget: MemoryBudget) -> None:
    assert MemoryBudget.parse(text) == budget


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0", "1X", "0.0"])
def test_malformed_budgets_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        MemoryBudget.parse(text)


def test_blocks_are_the_budget_over_the_bytes_per_block() -> None:
    # 4 layers x (2 x 16 tokens x 2 heads x 32 dims x 4 bytes = 8 KiB + a 64-byte trailer)
    assert block_bytes(TINY) == 4 * (8192 + 64)
    assert kv_cache_blocks(WorkerConfig(kv_cache_memory="512MiB"), TINY) == (512 << 20) // (4 * 8256)
    assert kv_cache_blocks(WorkerConfig(kv_cache_memory="0.5"), TINY, available_bytes=66048) == 1
    assert kv_cache_blocks(WorkerConfig(kv_cache_memory="1KiB"), TINY) == 1  # at least one
    assert kv_cache_blocks(WorkerConfig(num_blocks=7, kv_cache_memory="1G"), TINY) == 7  # the override


def test_bfloat16_holds_twice_the_blocks() -> None:
    half = KVLayout(4, 2, 32, 16, torch.bfloat16)
    assert block_bytes(half) == 4 * (4096 + 64)


def test_the_cache_memory_reads_as_zeros_and_is_writable() -> None:
    cache = PagedKVCache(TINY, 64)
    assert int(cache.kv.abs().sum()) == 0
    cache.kv[3].fill_(1.0)
    assert float(cache.kv[3].sum()) == cache.kv[3].numel() and int(cache.kv[2].abs().sum()) == 0
