"""vLLM's prefix-cache block hashes, computed outside vLLM, so that the router's prefix index
keys blocks exactly as vLLM's KV events report them.

vLLM 0.32 (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py) chains full blocks:

    NONE_HASH = H(seed)            seed: PYTHONHASHSEED if set, else "vllm-none-hash"
    h[0]      = H((NONE_HASH, tuple(tokens[0:bs]), None))
    h[i]      = H((h[i-1],    tuple(tokens[i*bs:(i+1)*bs]), None))

with H = sha256 over pickle (protocol 5; the default `--prefix-caching-hash-algo sha256`) or
sha256 over canonical CBOR (`sha256_cbor`, needs `cbor2`). The last element is the block's
extra keys (LoRA, multimodal, cache salt): None for plain text, the only case the router
hashes. Events carry each hash as bytes, or (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's
default) as the big-endian int of its low 64 bits (last 8 bytes); `event_key` maps both to
that int, the index's key. The non-cryptographic xxhash algorithms use a random seed unless
PYTHONHASHSEED is set, and are not supported here.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tsukimi.config import VLLM_HASH_ALGOS as HASH_ALGOS
from tsukimi.config import VllmHashAlgo as HashAlgo
from tsukimi.errors import ConfigError
from tsukimi.scheduler.index_sync import event_key as event_key

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def _sha256_pickle(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: object) -> bytes:
    import cbor2  # NOTE: optional; only the sha256_cbor algorithm needs it

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


@dataclass(frozen=True, slots=True)
class VllmHashConfig:
    """How the vLLM instances hash: their block size, `--prefix-caching-hash-algo`, and the
    NONE_HASH seed (None: PYTHONHASHSEED of this process if set, else vLLM's default)."""

    block_size: int = 128
    algo: HashAlgo = "sha256"
    seed: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"vLLM block_size must be > 0, got {self.block_size}")
        if self.algo not in HASH_ALGOS:
            raise ConfigError(f"vLLM hash algo must be one of {HASH_ALGOS}, got {self.algo!r}")


class VllmBlockHasher:
    """Full-block chained hashes of a token sequence, as vLLM computes them (see the module)."""

    def __init__(self, config: VllmHashConfig | None = None) -> None:
        self.config = config or VllmHashConfig()
        self._hash: Callable[[object], bytes] = _sha256_cbor if self.config.algo == "sha256_cbor" else _sha256_pickle
        seed = self.config.seed if self.config.seed is not None else os.getenv("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
        self.none_hash = self._hash(seed)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        """vLLM's block hashes of the full blocks of `tokens` (a partial last block has none); pure."""
        size, out = self.config.block_size, []
        parent = self.none_hash
        for start in range(0, len(tokens) - size + 1, size):
            parent = self._hash((parent, tuple(tokens[start : start + size]), None))
            out.append(parent)
        return out

    def keys(self, tokens: Sequence[int]) -> list[int]:
        """The prefix index's keys of `tokens`' full blocks (`event_key` of each hash); pure."""
        return [event_key(h) for h in self.hashes(tokens)]
