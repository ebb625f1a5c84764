"""The P2P store's settings (tsukimi/p2p/): shards, fan-out and holder liveness."""

from __future__ import annotations

from dataclasses import dataclass

from tsukimi.config.loader import require
from tsukimi.config.transfer import MIB


@dataclass(frozen=True, slots=True)
class P2PConfig:
    """How a P2P store cuts, fetches and advertises payloads.

    max_shard_bytes: a registered payload is cut into shards of at most this many bytes
        (a shard never spans two of the origin's buffers).
    max_inflight: shards one `get_replica` pulls at the same time.
    holder_ttl_s: a holder's liveness key lives this long after its last refresh (refreshed
        every third of it); a dead holder's replicas are ignored, then pruned, after it.
    shard_timeout_s: deadline of one shard's READ from one holder.
    cas_attempts: compare-and-set retries on the payload record before giving up.
    verify: check every fetched shard's crc32c (a mismatch is refetched from another holder).
    """

    max_shard_bytes: int = 64 * MIB
    max_inflight: int = 4
    holder_ttl_s: float = 10.0
    shard_timeout_s: float = 60.0
    cas_attempts: int = 64
    verify: bool = True

    def __post_init__(self) -> None:
        require(4096 <= self.max_shard_bytes <= 1024 * MIB, "p2p.max_shard_bytes must be in 4 KiB..1 GiB")
        require(1 <= self.max_inflight <= 64, "p2p.max_inflight must be in 1..64")
        require(0.5 <= self.holder_ttl_s <= 3600, "p2p.holder_ttl_s must be in 0.5..3600")
        require(self.shard_timeout_s > 0, "p2p.shard_timeout_s must be > 0")
        require(1 <= self.cas_attempts <= 10_000, "p2p.cas_attempts must be in 1..10000")
