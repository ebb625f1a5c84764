"""The KV cache store: its master (`MasterConfig`, `[master]`) and its clients (`ClientConfig`,
`[client]`), the tables of `Config` that `tsukimi master` and `tsukimi holder` read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from tsukimi.config.loader import require
from tsukimi.eviction import POLICY_NAMES, PolicyName

PlacementName = Literal["random", "most_free", "local_first"]
PLACEMENT_NAMES: tuple[str, ...] = get_args(PlacementName)
OffloadName = Literal["off", "on_evict", "on_put"]
OFFLOAD_NAMES: tuple[str, ...] = get_args(OffloadName)


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Store master settings.

    client_ttl_s: a client silent this long loses its segments and the replicas in them.
    heartbeat_interval_s: how often clients heartbeat; a client silent for 2.5 intervals (at most client_ttl_s)
        gets no new replicas.
    lease_ttl_s: how long a get keeps an object from being evicted or freed.
    put_timeout_s: a put started and not ended within this is reclaimed.
    write_grace_s: blocks of a revoked or reclaimed put stay out of use this long, since the
        failed writer's bytes may still be in flight; at least the clients' transfer timeout.
    high_watermark / evict_ratio: above this usage, evict this fraction of the capacity.
    ha_etcd: "etcd://HOST:PORT[,...]" runs this master as one of several against etcd: one
        is elected leader through an etcd lease of `ha_lease_ttl_s`, the others stand by; the
        leader logs every state change in etcd before acknowledging it and snapshots every
        `ha_snapshot_records` records (docs/reliability.md). "" runs a lone master, state
        in memory only. ha_cluster names the cluster's keys in etcd.
    placement: how replicas pick segments (preferred segments always come first).
    soft_pin_ttl_s: how long a soft pin lasts when a put does not say (Mooncake's default).
    eviction: the order objects are evicted in ("lru", "lfu"; see tsukimi/eviction.py).
    rpc_spin_us / rpc_spinners: after answering, a connection's thread polls for that
        client's next call this long before it sleeps, skipping a ~50-80 us wake-up on a VM;
        only while that client's previous call came within the window, and in at most
        `rpc_spinners` threads at once: polling costs at most that many CPUs while clients
        are busy and nothing while they are idle. 0 turns it off.
    offload: the disk tier (holders with `client.ssd_dir`; docs/ARCHITECTURE.md, "The
        store"): "on_evict" copies objects to their holder's disk when memory runs short
        (above `offload_watermark`, ahead of eviction) and eviction then frees the memory of
        copied objects instead of dropping them; "on_put" copies every object when its put
        ends; "off" never uses disks.
    promotion_on_hit: a get of an object that is only on disk copies it back to memory
        (once it had `promotion_admission_threshold` such gets) when there is room (free
        memory, or memory held by objects that are on disk too).
    disk_high_watermark: above this usage of a disk, evict its least recently used copies
        (an object whose only copy it was is gone) down to `disk_high_watermark - evict_ratio`.
    disk_task_timeout_s: a holder must finish a disk task within this (else it is cancelled).
    disk_inflight_bytes: at most this many bytes of offloads in flight per disk.
    disk_root: handed to clients that were asked to use a disk but given no directory
        (Mooncake's `root_fs_dir`); each keeps its own directory under it.
    hot_threshold: reads per second (a decaying average over `hot_window_s`) from which an
        object is hot and gets extra replicas on more holders, up to `hot_max_replicas` in all
        (tsukimi/store/master/hot.py); 0 turns hot-key replication off. The extras are dropped
        once the rate stayed below `hot_cool_ratio * hot_threshold` for `hot_cool_down_s`, and
        first (those of objects no longer hot) under eviction pressure.
    """

    host: str = "127.0.0.1"
    rpc_port: int = 50051
    http_port: int = 8081
    client_ttl_s: float = 3.0
    heartbeat_interval_s: float = 1.0
    lease_ttl_s: float = 5.0
    put_timeout_s: float = 30.0
    write_grace_s: float = 30.0
    high_watermark: float = 0.90
    evict_ratio: float = 0.05
    placement: PlacementName = "random"
    eviction: PolicyName = "lru"
    seed: int = 0
    tick_interval_s: float = 0.1
    rpc_spin_us: float = 1000.0
    rpc_spinners: int = 1
    ha_etcd: str = ""
    ha_cluster: str = "tsukimi"
    ha_lease_ttl_s: int = 2
    ha_snapshot_records: int = 20000
    ha_commit_timeout_s: float = 5.0
    soft_pin_ttl_s: float = 1800.0
    offload: OffloadName = "on_evict"
    offload_watermark: float = 0.70
    promotion_on_hit: bool = True
    promotion_admission_threshold: int = 1
    disk_high_watermark: float = 0.95
    disk_task_timeout_s: float = 10.0
    disk_inflight_bytes: int = 256 << 20
    disk_root: str = ""
    hot_threshold: float = 0.0
    hot_max_replicas: int = 3
    hot_window_s: float = 10.0
    hot_cool_ratio: float = 0.5
    hot_cool_down_s: float = 30.0

    def __post_init__(self) -> None:
        require(0 <= self.rpc_spin_us <= 1e6, "master.rpc_spin_us must be in [0, 1e6]")
        self._check_disk_tier()
        self._check_hot()
        require(
            not self.ha_etcd or self.ha_etcd.startswith("etcd://"),
            f"master.ha_etcd must be empty or etcd://HOST:PORT[,HOST:PORT], got {self.ha_etcd!r}",
        )
        require(
            bool(self.ha_cluster) and all(c.isalnum() or c in "-_." for c in self.ha_cluster),
            f"master.ha_cluster must be a non-empty name of letters, digits, -, _ and ., got {self.ha_cluster!r}",
        )
        require(2 <= self.ha_lease_ttl_s <= 600, "master.ha_lease_ttl_s must be in 2..600 (etcd's minimum is 2)")
        require(self.ha_snapshot_records >= 100, "master.ha_snapshot_records must be >= 100")
        require(self.ha_commit_timeout_s > 0, "master.ha_commit_timeout_s must be > 0")
        require(0 <= self.rpc_spinners <= 64, "master.rpc_spinners must be in 0..64")
        require(
            self.eviction in POLICY_NAMES,
            f"master.eviction must be one of {', '.join(POLICY_NAMES)}, got {self.eviction!r}",
        )
        require(
            self.placement in PLACEMENT_NAMES,
            f"master.placement must be one of {', '.join(PLACEMENT_NAMES)}, got {self.placement!r}",
        )
        for name in ("rpc_port", "http_port"):
            require(0 <= getattr(self, name) <= 65535, f"master.{name} must be in 0..65535")
        for name in ("client_ttl_s", "heartbeat_interval_s", "lease_ttl_s", "put_timeout_s", "tick_interval_s"):
            require(getattr(self, name) > 0, f"master.{name} must be > 0")
        require(self.write_grace_s >= 0, "master.write_grace_s must be >= 0")
        require(self.soft_pin_ttl_s >= 0, "master.soft_pin_ttl_s must be >= 0")
        require(self.heartbeat_interval_s < self.client_ttl_s, "master.heartbeat_interval_s must be < client_ttl_s")
        require(0 < self.high_watermark <= 1, "master.high_watermark must be in (0, 1]")
        require(0 < self.evict_ratio <= 1, "master.evict_ratio must be in (0, 1]")

    def _check_disk_tier(self) -> None:
        require(
            self.offload in OFFLOAD_NAMES,
            f"master.offload must be one of {', '.join(OFFLOAD_NAMES)}, got {self.offload!r}",
        )
        require(0 < self.offload_watermark <= 1, "master.offload_watermark must be in (0, 1]")
        require(0 < self.disk_high_watermark <= 1, "master.disk_high_watermark must be in (0, 1]")
        require(self.promotion_admission_threshold >= 1, "master.promotion_admission_threshold must be >= 1")
        require(self.disk_task_timeout_s > 0, "master.disk_task_timeout_s must be > 0")
        require(self.disk_inflight_bytes > 0, "master.disk_inflight_bytes must be > 0")

    def _check_hot(self) -> None:
        require(self.hot_threshold >= 0, "master.hot_threshold must be >= 0 (0: off)")
        require(2 <= self.hot_max_replicas <= 8, "master.hot_max_replicas must be in 2..8")
        require(self.hot_window_s > 0, "master.hot_window_s must be > 0")
        require(0 < self.hot_cool_ratio < 1, "master.hot_cool_ratio must be in (0, 1)")
        require(self.hot_cool_down_s >= 0, "master.hot_cool_down_s must be >= 0")


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Store client settings.

    master: the master's RPC endpoint, or etcd://HOST:PORT[,...] to follow the elected leader
    of an HA master group (`ha_cluster` names it); calls that fail because the leader changed
    are retried for up to `failover_timeout_s`. checksum: store a crc32c with every object
    put and verify it on every get (a replica that fails is skipped). segment_bytes: memory
    this client contributes to the
    pool (0: a pure client). ssd_dir / ssd_bytes: this holder's disk directory for the
    master-tracked disk tier (needs segment_bytes > 0: objects move between this holder's
    memory and its disk; any client reads them); `disk_poll_s`: how often the holder asks the
    master for disk work when it has none; `ssd_verify`: check every file's crc32c when the
    directory is registered at start (else only its header and size). put_wait_s: how long a put
    refused with OffloadPending (memory is being copied to disk to make room) keeps trying. rpc_spin_us: how long a call
    to the master polls for its reply before sleeping (saves a ~50 us wake-up per call on a
    VM; costs at most this much CPU per call; 0 never polls).
    """

    master: str = "tcp://127.0.0.1:50051"
    segment_bytes: int = 0
    rpc_timeout_s: float = 5.0
    rpc_spin_us: float = 250.0
    heartbeat_interval_s: float = 1.0
    ssd_dir: str = ""
    ssd_bytes: int = 0
    disk_poll_s: float = 0.05
    ssd_verify: bool = True
    put_wait_s: float = 2.0
    ha_cluster: str = "tsukimi"
    failover_timeout_s: float = 10.0
    checksum: bool = False

    def __post_init__(self) -> None:
        require(
            self.master.startswith(("tcp://", "etcd://")),
            f"client.master must be tcp://HOST:PORT or etcd://HOST:PORT[,...], got {self.master!r}",
        )
        require(self.failover_timeout_s > 0, "client.failover_timeout_s must be > 0")
        require(self.segment_bytes >= 0, "client.segment_bytes must be >= 0")
        require(self.rpc_timeout_s > 0 and self.heartbeat_interval_s > 0, "client timeouts must be > 0")
        require(0 <= self.rpc_spin_us <= 1e6, "client.rpc_spin_us must be in [0, 1e6]")
        require(not self.ssd_dir or self.ssd_bytes > 0, "client.ssd_bytes must be > 0 when ssd_dir is set")
        require(
            not self.ssd_dir or self.segment_bytes > 0,
            "client.ssd_dir needs client.segment_bytes > 0 (a disk holds what its holder's memory held)",
        )
        require(0 < self.disk_poll_s <= 10, "client.disk_poll_s must be in (0, 10]")
        require(self.put_wait_s >= 0, "client.put_wait_s must be >= 0")
