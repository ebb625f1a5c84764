"""In-process prefill timing on one device, for `tsukimi bench gpu`: one engine, a prompt
computed in full, then a prompt that shares a prefix with it and reuses that prefix's KV.

    prefill_s   the whole prompt computed (first token out), device synchronized
    load_s      the prefix's KV brought into the cache from pinned host rows: ONE host-to-device
                copy + one scatter (tsukimi/engine/kv_staging.py), as a pooled prefix arrives
    compute_s   the rest of the prompt computed over the cached prefix (first token out)
    reuse_s     load_s + compute_s: what a prefix hit from the KV pool costs, minus the store's
                own reads into the staging (the real-process benches measure those)

GPU.md's raw limits for the Llama-3-8B shape on an H200: prefill 16k 0.535 s, reuse 0.070 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tsukimi.engine.device import resolve_device, resolve_dtype, synchronize
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.kv_staging import HostArena, SlotStaging
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import load_model
from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.block_hash import hash_blocks

BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    """Seconds of one prompt's prefill, and of its reuse of `prefix_tokens` (None: no prefix)."""

    prompt_tokens: int
    prefix_tokens: int
    prefill_s: float
    load_s: float | None
    compute_s: float | None

    @property
    def reuse_s(self) -> float | None:
        return None if self.load_s is None or self.compute_s is None else self.load_s + self.compute_s


def time_prefill(
    model_name: str, prompt_tokens: int, device: str = "auto", dtype: str = "auto", prefix_tokens: int = 0
) -> PrefillTiming:
    """Build the engine once and time a prefill of `prompt_tokens`, then (with `prefix_tokens`)
    a prompt sharing its first `prefix_tokens` (whole blocks of 16) and reusing their KV (see
    the module). Each figure is one run after a warm-up of the same shape.

    Args:
        model_name: a model spec (`load_model`), e.g. "random:llama3-8b".
        device / dtype: as `tsukimi worker --device/--dtype`.

    Raises:
        ConfigError: a bad spec, device or dtype. InvalidArgument: a prefix not shorter than the prompt.
    """
    if not 0 <= prefix_tokens < prompt_tokens:
        raise InvalidArgument(f"prefix_tokens ({prefix_tokens}) must be in 0..prompt_tokens - 1 ({prompt_tokens})")
    where = resolve_device(device)
    loaded = load_model(model_name, resolve_dtype(dtype, where), where)
    mc = loaded.config
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, BLOCK_TOKENS, mc.torch_dtype)
    num_blocks = 4 * -(-prompt_tokens // BLOCK_TOKENS) + 8
    engine = LLMEngine(loaded.model, layout, num_blocks, max_batched_tokens=prompt_tokens, device=where)
    generator = torch.Generator().manual_seed(prompt_tokens)
    vocab = mc.vocab_size

    def prompt() -> list[int]:
        return torch.randint(3, vocab, (prompt_tokens,), generator=generator).tolist()

    def first_token_s(tokens: list[int]) -> float:
        synchronize(where)
        start = time.perf_counter()
        engine.generate([tokens], SamplingParams(max_tokens=1, ignore_eos=True))
        synchronize(where)
        return time.perf_counter() - start

    first_token_s(prompt())  # NOTE: the warm-up (kernels, allocator)
    full = prompt()
    prefill_s = first_token_s(full)
    if not prefix_tokens:
        return PrefillTiming(prompt_tokens, 0, prefill_s, None, None)
    prefix = full[: prefix_tokens - prefix_tokens % BLOCK_TOKENS]
    blocks = engine.cache.pool.lookup(hash_blocks(prefix, BLOCK_TOKENS))  # the prefill cached them
    engine.cache.pool.release(blocks)
    staging = SlotStaging(engine.cache)
    ids = staging.slot_ids(blocks, range(mc.num_layers))
    rows = HostArena(layout.slot_bytes, where).take(len(ids))
    engine.cache.order.host_waits(staging.gather(ids, rows))  # NOTE: the prefix in pinned host memory
    synchronize(where)
    start = time.perf_counter()
    engine.cache.order.host_waits(staging.scatter(ids, rows))
    synchronize(where)
    load_s = time.perf_counter() - start
    compute_s = first_token_s(prefix + prompt()[: prompt_tokens - len(prefix)])
    return PrefillTiming(prompt_tokens, len(prefix), prefill_s, load_s, compute_s)
