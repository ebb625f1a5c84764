"""KV blocks in the store (the KV pool): how a prefill instance publishes the blocks it
computed and how any instance loads a prefix that is already there.

One store object per full block, keyed by the block's chained hash under a prefix that
digests the KV format (model identity, dtype, layer count, KV heads, head size, block size),
so instances of different models or layouts never read each other's blocks. Each object
starts with a 64-byte header that repeats the format digest and the block hash; a block
whose header or size does not match is refused (`KVFormatError`) instead of being used::

    | magic "TSKV" | version u32 | format digest 16 B | block hash u64 | payload bytes u64 | pad |
    | payload: kv[layer, k|v, token, kv head, head dim] of one block (KVLayout)             |

Loading stops at the first block the pool does not have (lost, evicted or never written):
the engine computes the rest, so a lost block costs time, never correctness.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.errors import ObjectExists, TsukimiError
from tsukimi.store.client import StoreClient

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sI16sQQ")
HEADER_BYTES = 64
_MAGIC, _VERSION = b"TSKV", 1


class KVFormatError(TsukimiError):
    """A KV block in the pool was written in another format (model, dtype, layout)."""

    code = "kv_format"


@dataclass(frozen=True, slots=True)
class KVFormat:
    model_identity: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int

    @classmethod
    def of(cls, model_identity: str, layout: KVLayout) -> KVFormat:
        return cls(model_identity, str(layout.dtype).removeprefix("torch."), layout.num_layers,
                   layout.num_kv_heads, layout.head_dim, layout.block_tokens)  # fmt: skip

    @property
    def digest(self) -> bytes:
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=16).digest()

    @property
    def prefix(self) -> str:
        return f"kv/{self.digest.hex()}"

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}/{block_hash:016x}"


class StoreKVConnector:
    """The engine's `KVConnector` over a `StoreClient` (thread-safe as the client is)."""

    def __init__(self, client: StoreClient, fmt: KVFormat, replicas: int = 1) -> None:
        self.client, self.format, self.replicas = client, fmt, replicas
        self.loaded_blocks = self.saved_blocks = 0
        described = json.dumps(asdict(fmt), sort_keys=True).encode()
        with contextlib.suppress(ObjectExists):  # NOTE: for readers of the pool: what the digest stands for
            client.put(f"{fmt.prefix}/format", described, pin="soft")

    def load(self, hashes: Sequence[int], blocks: Sequence[int], cache: PagedKVCache) -> int:
        if not hashes:
            return 0
        size = HEADER_BYTES + cache.layout.block_bytes
        staging = [bytearray(size) for _ in hashes]
        got = self.client.batch_get_into([self.format.key(h) for h in hashes], staging)
        loaded = 0
        for block_hash, block, buffer, length in zip(hashes, blocks, staging, got, strict=False):
            if length != size:  # missing (0), unreadable (-1) or another size: compute from here on
                if length not in (0, -1):
                    raise KVFormatError(f"KV block {block_hash:016x} holds {length} bytes, expected {size}")
                break
            self._check_header(buffer, block_hash, cache.layout.block_bytes)
            cache.block_bytes(block)[:] = memoryview(buffer)[HEADER_BYTES:]
            loaded += 1
        self.loaded_blocks += loaded
        return loaded

    def save(self, hashes: Sequence[int], blocks: Sequence[int], cache: PagedKVCache) -> None:
        items = []
        for block_hash, block in zip(hashes, blocks, strict=True):
            header = _HEADER.pack(_MAGIC, _VERSION, self.format.digest, block_hash, cache.layout.block_bytes)
            items.append((self.format.key(block_hash), header.ljust(HEADER_BYTES, b"\0") + cache.block_bytes(block)))
        errors = self.client.batch_put(items, replicas=self.replicas)
        for (key, _), error in zip(items, errors, strict=True):
            if error is None:
                self.saved_blocks += 1
            elif not isinstance(error, ObjectExists):  # another instance published it first: fine
                logger.warning("could not publish KV block %s: %s", key, error)

    def _check_header(self, buffer: bytearray, block_hash: int, payload: int) -> None:
        magic, version, digest, found_hash, found_payload = _HEADER.unpack_from(buffer)
        if magic != _MAGIC or version != _VERSION or digest != self.format.digest:
            raise KVFormatError(f"KV block {block_hash:016x} was written in another format: refusing it")
        if found_hash != block_hash or found_payload != payload:
            raise KVFormatError(f"KV block {block_hash:016x}: header names block {found_hash:016x}")
