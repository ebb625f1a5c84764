"""What a KV block is called in the pool, and which blocks a request may load or must save.

Pure functions and frozen dataclasses, no vLLM import: the scheduler and worker halves of the
connector (and tsukimi's unit tests) share them.

A block's bytes depend on more than its tokens: the model, the KV dtype, the block size, the
per-layer block shape and the attention kernel's packing (on x86 CPUs vLLM's "vec" kernels
store K transposed inside a block; AMX/bf16 packs it otherwise). `KVFormat` names all of it and
`KVFormat.digest()` condenses it into 16 hex digits that prefix every key, so two instances
share blocks exactly when their bytes are interchangeable.

vLLM's KV cache on CPU is one buffer cut into per-layer views (layout "LBHNC"), so one block
of one layer is contiguous but a block across layers is not::

    buffer:  | layer 0: block 0 | block 1 | ... | layer 1: block 0 | block 1 | ... |
              <- block_bytes ->

Each (block, layer) is therefore its own object, `{digest}/{block hash hex}/{layer}`: put
straight from the KV buffer and read straight into it, never gathered into a staging copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)  # vLLM's chained block hash (sha256 by default)
KEY_PREFIX = "vllm"


@dataclass(frozen=True, slots=True)
class KVFormat:
    """Everything that decides a KV block's bytes, besides its tokens.

    model: the model's name or path as vLLM was given it, with its revision when known.
    dtype: the KV cache dtype ("float32", "bfloat16", "fp8_e4m3"...).
    block_size: tokens per block.
    block_shape: one layer's block, e.g. (kv_heads, block_size, 2 * head_dim) on CPU.
    num_layers: attention layers holding KV.
    kernel: the attention kernel's packing, e.g. "cpu:x86_64:vec" or "cuda:NHD".
    hash_algo: the algorithm vLLM chains block hashes with (and its NONE_HASH seed).
    """

    model: str
    dtype: str
    block_size: int
    block_shape: tuple[int, ...]
    num_layers: int
    kernel: str
    hash_algo: str = "sha256"

    def digest(self) -> str:
        """16 hex digits naming this format (stable across processes and hosts)."""
        text = "|".join(
            [
                self.model,
                self.dtype,
                str(self.block_size),
                ",".join(map(str, self.block_shape)),
                str(self.num_layers),
                self.kernel,
                self.hash_algo,
            ]
        )
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def block_key(digest: str, block_hash: bytes, layer: int) -> str:
    """The pool key of one layer of one block."""
    return f"{KEY_PREFIX}/{digest}/{block_hash.hex()}/{layer}"


def block_keys(digest: str, block_hash: bytes, num_layers: int) -> list[str]:
    """The keys of every layer of one block, in layer order."""
    return [block_key(digest, block_hash, layer) for layer in range(num_layers)]


def max_loadable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks a request of `num_tokens` may take from outside.

    Never the whole prompt: vLLM must compute at least one token to sample from, so the cap
    is `(num_tokens - 1) // block_size` (a 640-token prompt in 128-token blocks: 4, not 5).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return max(0, (num_tokens - 1) // block_size)


def leading_hits(found: Sequence[bool], num_layers: int) -> int:
    """How many leading blocks are complete, given `found` for each block's layer keys in
    block-major order (block 0's layers, then block 1's...): a block counts only when all its
    layers exist, and the first incomplete block ends the prefix."""
    if num_layers <= 0 or len(found) % num_layers:
        raise ValueError(f"{len(found)} answers do not divide into {num_layers} layers")
    for block in range(len(found) // num_layers):
        if not all(found[block * num_layers : (block + 1) * num_layers]):
            return block
    return len(found) // num_layers


@dataclass(frozen=True, slots=True)
class SaveRange:
    """Blocks `[start, end)` of a request became full in this step and are to be saved."""

    start: int
    end: int


def blocks_to_save(num_saved: int, num_computed_tokens: int, num_prompt_tokens: int, block_size: int) -> SaveRange:
    """The prompt blocks that are full once `num_computed_tokens` are computed and were not
    saved yet (`num_saved` blocks were). Generated tokens' blocks are not saved: the pool
    serves prompts. An empty range when there is nothing new."""
    end = min(num_computed_tokens, num_prompt_tokens) // block_size
    return SaveRange(num_saved, max(num_saved, end))
