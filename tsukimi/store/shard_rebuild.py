"""Putting the equal shards of one tensor back together, and the manifest that says how many.

This module owns `Manifest` (the small object a layout's writers store beside their shards:
the shard count, the split_dim and the whole shape; the bytes are tsukimi's own, Mooncake
keeps the same facts under the same keys) and `assemble`, which checks the shard objects
read for one tensor as Mooncake's store_py.cpp does and concatenates them:

    shard r of n    its object is a tensor marked rank r of n along split_dim
    all shards      the same dtype and shape (uniform shards only)
    whole shape     the shard shape with split_dim times n; the manifest's when there is one;
                    its split_dim divisible by the TP size the reader asked for

Which keys hold the shards is tensor_parallel.py's business.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tsukimi.errors import KVFormatError
from tsukimi.store.replica_io import GetResult
from tsukimi.store.tensor_format import deserialize
from tsukimi.store.tensors import TensorResult

logger = logging.getLogger(__name__)

_MANIFEST = struct.Struct("<4sIIiI")  # magic, version, shard count, split_dim, ndim; then ndim u64 sizes
_MANIFEST_MAGIC = b"TSKL"
_MANIFEST_VERSION = 2


@dataclass(frozen=True, slots=True)
class Manifest:
    """`count` equal shards along `split_dim` make a whole tensor of `shape`."""

    count: int
    split_dim: int
    shape: tuple[int, ...]

    @classmethod
    def of(cls, shard: torch.Tensor, count: int, split_dim: int) -> Manifest:
        """The manifest of `count` shards shaped like `shard` along `split_dim` (in range)."""
        shape = list(shard.shape)
        shape[split_dim] *= count
        return cls(count, split_dim, tuple(shape))

    def pack(self) -> bytes:
        head = _MANIFEST.pack(_MANIFEST_MAGIC, _MANIFEST_VERSION, self.count, self.split_dim, len(self.shape))
        return head + struct.pack(f"<{len(self.shape)}Q", *self.shape)

    @classmethod
    def parse(cls, raw: bytes) -> Manifest | None:
        """The manifest in `raw`, or None (logged) for anything else."""
        if len(raw) >= _MANIFEST.size:
            magic, version, count, split_dim, ndim = _MANIFEST.unpack_from(raw)
            if (
                magic == _MANIFEST_MAGIC
                and version == _MANIFEST_VERSION
                and len(raw) == _MANIFEST.size + 8 * ndim
                and count >= 1
                and 0 <= split_dim < ndim
            ):
                return cls(count, split_dim, struct.unpack_from(f"<{ndim}Q", raw, _MANIFEST.size))
        logger.warning("ignoring a malformed shard manifest")
        return None


def stored_count(shard: GetResult) -> int:
    """How many shards the object read as shard 0 says make its tensor (0: not a shard)."""
    if shard.data is None:
        return 0
    try:
        header, _ = deserialize(shard.data)
    except KVFormatError:
        return 0
    return header.shard.size if header.shard.rank == 0 else 0


def assemble(
    key: str, shards: Sequence[GetResult], split_dim: int | None, manifest: Manifest | None = None, asked: int = 0
) -> TensorResult:
    """The whole tensor of `key` from its shard objects read in rank order (module docstring).

    Args:
        key: the tensor's key, for messages.
        shards: shard r's object at index r; their number is the shard count.
        split_dim: the dim the shards must be cut along (None: whatever the first says).
        manifest: the manifest read for them, if any: its shape must be the whole one.
        asked: a TP size the whole must also split into evenly (0: none).

    Returns:
        The tensor (a new one); a miss when a shard is missing; the first read error; else
        a KVFormatError for shards that do not make one tensor.
    """
    failed = next((s.error for s in shards if s.error is not None), None)
    if failed is not None or any(s.data is None for s in shards) or not shards:
        return TensorResult(error=failed)
    count = len(shards)
    try:
        parts = [deserialize(s.data) for s in shards if s.data is not None]
    except KVFormatError as exc:
        return TensorResult(error=KVFormatError(f"a shard of {key!r} is not a tensor: {exc}"))
    first = parts[0][0]
    dim = first.shard.split_dim if split_dim is None else split_dim
    for rank, (header, _) in enumerate(parts):
        placement = header.shard
        if (placement.rank, placement.size, placement.split_dim) != (rank, count, dim):
            return _mismatch(
                key, f"shard {rank} is marked {placement.rank} of {placement.size} along {placement.split_dim}"
            )
        if (header.dtype, header.shape) != (first.dtype, first.shape):
            return _mismatch(key, f"shard {rank} is {header.dtype} {header.shape}, shard 0 {first.dtype} {first.shape}")
    shape = list(first.shape)
    shape[dim] *= count
    if manifest is not None and tuple(shape) != manifest.shape:
        return _mismatch(key, f"the shards make {tuple(shape)}, the manifest says {manifest.shape}")
    if asked and shape[dim] % asked:
        return _mismatch(key, f"dim {dim} of size {shape[dim]} does not split into {asked} equal shards")
    return TensorResult(torch.cat([tensor for _, tensor in parts], dim))


def _mismatch(key: str, why: str) -> TensorResult:
    return TensorResult(error=KVFormatError(f"the shards of {key!r} do not make one tensor: {why}"))
