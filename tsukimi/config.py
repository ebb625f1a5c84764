"""Configuration: one frozen dataclass per subsystem, composed into `Config`.

Values come from defaults, then a TOML file, then `--set section.key=value` overrides.
Unknown sections and keys are errors, and each dataclass validates itself in
`__post_init__`, raising `ConfigError` that names the valid choices.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args, get_origin

from tsukimi.errors import ConfigError
from tsukimi.eviction import POLICY_NAMES, PolicyName

TransportName = Literal["auto", "shm", "cma", "tcp"]
TRANSPORT_NAMES: tuple[str, ...] = get_args(TransportName)
MIB = 1 << 20


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Transfer Engine settings.

    transport: "auto" picks shm for shared-memory buffers of a peer on this host and tcp
        otherwise; "shm" or "tcp" force one (a request the forced transport cannot serve fails).
    num_connections: parallel TCP connections per peer that large transfers are striped over.
    slice_bytes: requests larger than this are split into slices of this size.
    timeout_s: default deadline of a request, from submission to completion.
    """

    transport: TransportName = "auto"
    bind_host: str = "127.0.0.1"
    port: int = 0
    num_connections: int = 4
    slice_bytes: int = 2 * MIB
    max_slice_bytes: int = 64 * MIB
    pipeline_depth: int = 8
    timeout_s: float = 30.0
    connect_timeout_s: float = 3.0
    max_retries: int = 2
    num_shm_workers: int = 2
    max_server_connections: int = 256
    shm_dir: str = "/dev/shm"

    def __post_init__(self) -> None:
        _require(
            self.transport in TRANSPORT_NAMES,
            f"transfer.transport must be one of {', '.join(TRANSPORT_NAMES)}, got {self.transport!r}",
        )
        _require(0 <= self.port <= 65535, f"transfer.port must be in 0..65535, got {self.port}")
        _require(1 <= self.num_connections <= 64, "transfer.num_connections must be in 1..64")
        _require(
            4096 <= self.slice_bytes <= self.max_slice_bytes,
            f"transfer.slice_bytes must be in 4096..max_slice_bytes ({self.max_slice_bytes})",
        )
        _require(self.max_slice_bytes <= 1 << 30, "transfer.max_slice_bytes must be <= 1 GiB")
        _require(1 <= self.pipeline_depth <= 64, "transfer.pipeline_depth must be in 1..64")
        _require(self.timeout_s > 0, "transfer.timeout_s must be > 0")
        _require(self.connect_timeout_s > 0, "transfer.connect_timeout_s must be > 0")
        _require(0 <= self.max_retries <= 16, "transfer.max_retries must be in 0..16")
        _require(1 <= self.num_shm_workers <= 64, "transfer.num_shm_workers must be in 1..64")
        _require(self.max_server_connections >= 1, "transfer.max_server_connections must be >= 1")


@dataclass(frozen=True, slots=True)
class MetadataConfig:
    """Where segment descriptors are published.

    url: "p2p" (no service: peers exchange descriptors by handshake, segment names are
        host:port), "memory://NAME" (in-process, tests), "http://host:port/metadata"
        (`tsukimi metadata-server`), or "etcd://host:port[,host:port...]".
    """

    url: str = "p2p"
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        ok = self.url == "p2p" or self.url.startswith(("memory://", "http://", "etcd://"))
        _require(
            ok,
            f"metadata.url must be p2p, memory://NAME, http://HOST:PORT/PATH or "
            f"etcd://HOST:PORT[,...], got {self.url!r}",
        )
        _require(self.timeout_s > 0, "metadata.timeout_s must be > 0")


PlacementName = Literal["random", "most_free", "local_first"]
PLACEMENT_NAMES: tuple[str, ...] = get_args(PlacementName)


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Store master settings.

    client_ttl_s: a client silent this long loses its segments and the replicas in them.
    heartbeat_interval_s: how often clients heartbeat; a client silent for 1.5 intervals
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
    eviction: the order objects are evicted in ("lru", "lfu"; see tsukimi/eviction.py).
    rpc_spin_us / rpc_spinners: after answering, a connection's thread polls for that
        client's next call this long before it sleeps, skipping a ~50-80 us wake-up on a VM;
        only while that client's previous call came within the window, and in at most
        `rpc_spinners` threads at once: polling costs at most that many CPUs while clients
        are busy and nothing while they are idle. 0 turns it off.
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

    def __post_init__(self) -> None:
        _require(0 <= self.rpc_spin_us <= 1e6, "master.rpc_spin_us must be in [0, 1e6]")
        _require(
            not self.ha_etcd or self.ha_etcd.startswith("etcd://"),
            f"master.ha_etcd must be empty or etcd://HOST:PORT[,HOST:PORT], got {self.ha_etcd!r}",
        )
        _require(
            bool(self.ha_cluster) and all(c.isalnum() or c in "-_." for c in self.ha_cluster),
            f"master.ha_cluster must be a non-empty name of letters, digits, -, _ and ., got {self.ha_cluster!r}",
        )
        _require(2 <= self.ha_lease_ttl_s <= 600, "master.ha_lease_ttl_s must be in 2..600 (etcd's minimum is 2)")
        _require(self.ha_snapshot_records >= 100, "master.ha_snapshot_records must be >= 100")
        _require(self.ha_commit_timeout_s > 0, "master.ha_commit_timeout_s must be > 0")
        _require(0 <= self.rpc_spinners <= 64, "master.rpc_spinners must be in 0..64")
        _require(
            self.eviction in POLICY_NAMES,
            f"master.eviction must be one of {', '.join(POLICY_NAMES)}, got {self.eviction!r}",
        )
        _require(
            self.placement in PLACEMENT_NAMES,
            f"master.placement must be one of {', '.join(PLACEMENT_NAMES)}, got {self.placement!r}",
        )
        for name in ("rpc_port", "http_port"):
            _require(0 <= getattr(self, name) <= 65535, f"master.{name} must be in 0..65535")
        for name in ("client_ttl_s", "heartbeat_interval_s", "lease_ttl_s", "put_timeout_s", "tick_interval_s"):
            _require(getattr(self, name) > 0, f"master.{name} must be > 0")
        _require(self.write_grace_s >= 0, "master.write_grace_s must be >= 0")
        _require(self.heartbeat_interval_s < self.client_ttl_s, "master.heartbeat_interval_s must be < client_ttl_s")
        _require(0 < self.high_watermark <= 1, "master.high_watermark must be in (0, 1]")
        _require(0 < self.evict_ratio <= 1, "master.evict_ratio must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Store client settings.

    master: the master's RPC endpoint, or etcd://HOST:PORT[,...] to follow the elected leader
    of an HA master group (`ha_cluster` names it); calls that fail because the leader changed
    are retried for up to `failover_timeout_s`. checksum: store a crc32c with every object
    put and verify it on every get (a replica that fails is skipped). segment_bytes: memory
    this client contributes to the
    pool (0: a pure client). ssd_dir / ssd_bytes: the optional SSD tier (write-through; gets
    that miss in memory are served from it and promoted back). rpc_spin_us: how long a call
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
    ha_cluster: str = "tsukimi"
    failover_timeout_s: float = 10.0
    checksum: bool = False

    def __post_init__(self) -> None:
        _require(
            self.master.startswith(("tcp://", "etcd://")),
            f"client.master must be tcp://HOST:PORT or etcd://HOST:PORT[,...], got {self.master!r}",
        )
        _require(self.failover_timeout_s > 0, "client.failover_timeout_s must be > 0")
        _require(self.segment_bytes >= 0, "client.segment_bytes must be >= 0")
        _require(self.rpc_timeout_s > 0 and self.heartbeat_interval_s > 0, "client timeouts must be > 0")
        _require(0 <= self.rpc_spin_us <= 1e6, "client.rpc_spin_us must be in [0, 1e6]")
        _require(not self.ssd_dir or self.ssd_bytes > 0, "client.ssd_bytes must be > 0 when ssd_dir is set")


SECRET_ENV = "TSUKIMI_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """The optional shared cluster secret (docs/security.md).

    When set, every control-plane (RPC) and Transfer Engine connection authenticates both
    ways with an HMAC-SHA256 challenge-response before anything else is accepted, and the
    metadata and master HTTP APIs require signed requests. The secret is read from
    `secret_file` (one line; at least 16 bytes), or from the environment variable
    TSUKIMI_CLUSTER_SECRET, which wins. Never put it on a command line.
    """

    secret_file: str = ""

    def secret(self) -> bytes | None:
        """The cluster secret, or None when none is configured.

        Raises:
            ConfigError: the file cannot be read, or the secret is shorter than 16 bytes.
        """
        import os

        raw = os.environ.get(SECRET_ENV)
        if raw is None and self.secret_file:
            try:
                raw = Path(self.secret_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read security.secret_file {self.secret_file}: {exc}") from exc
        if not raw:
            return None
        secret = raw.encode()
        _require(len(secret) >= MIN_SECRET_BYTES, f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        return secret


RejectionName = Literal["none", "baseline", "early", "predicted"]
REJECTION_NAMES: tuple[str, ...] = get_args(RejectionName)


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    """The Conductor (tsukimi/scheduler/conductor.py).

    block_tokens: tokens per KV block (the traces' 512).
    ttft_slo_s / tbt_slo_s: the service-level objectives a placement must meet.
    rejection: "none" admits everything; "baseline" checks TTFT at arrival and the decode
        load only when prefill is done (a request rejected then wasted its prefill); "early"
        also checks the current decode load at arrival; "predicted" checks the decode load
        predicted for when the request would reach decode.
    reuse: "global": a prefill instance may fetch a longer prefix from any other cache (the
        pool); "local": only its own cache counts (the per-instance baseline).
    balancing_threshold: a prefill instance fetches a longer prefix from elsewhere only when
        it is at least this many times its local match (else it recomputes the difference);
        a fetched prefix stays in its cache (hot-spot replication).
    prefill_chunk_tokens: prefill instances compute at most this many tokens per iteration.
    kv_bandwidth_bytes_s: KV transfer bandwidth between instances and the pool.
    decode_estimate_s: a request's decode stage length assumed before any has finished (then
        the distribution of the observed ones is used).
    """

    block_tokens: int = 512
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    rejection: RejectionName = "predicted"
    reuse: Literal["global", "local"] = "global"
    balancing_threshold: float = 1.0
    prefill_chunk_tokens: int = 8192
    kv_bandwidth_bytes_s: float = 100e9
    decode_estimate_s: float = 10.0

    def __post_init__(self) -> None:
        _require(
            self.rejection in REJECTION_NAMES,
            f"conductor.rejection must be one of {', '.join(REJECTION_NAMES)}, got {self.rejection!r}",
        )
        _require(self.block_tokens > 0, "conductor.block_tokens must be > 0")
        for name in ("ttft_slo_s", "tbt_slo_s", "kv_bandwidth_bytes_s", "decode_estimate_s"):
            _require(getattr(self, name) > 0, f"conductor.{name} must be > 0")
        _require(self.reuse in ("global", "local"), f"conductor.reuse must be global or local, got {self.reuse!r}")
        _require(self.balancing_threshold >= 1, "conductor.balancing_threshold must be >= 1")
        _require(self.prefill_chunk_tokens > 0, "conductor.prefill_chunk_tokens must be > 0")


@dataclass(frozen=True, slots=True)
class Config:
    """Every subsystem's configuration."""

    transfer: TransferConfig = field(default_factory=TransferConfig)
    metadata: MetadataConfig = field(default_factory=MetadataConfig)
    master: MasterConfig = field(default_factory=MasterConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Build a `Config` from defaults, an optional TOML file and `section.key=value` overrides.

    Raises:
        ConfigError: unreadable file, unknown section or key, wrong type, invalid value.
    """
    return build_dataclass(Config, read_settings(path, overrides), "")


def read_settings(
    path: str | Path | None, overrides: typing.Iterable[str], top_level_keys: bool = False
) -> dict[str, typing.Any]:
    """The tables of an optional TOML file with `section.key=value` overrides applied (a value
    is read as TOML, else taken as a bare string: `model=tiny`); with `top_level_keys`,
    `key=value` sets a top-level key too. Every settings file of tsukimi is read this way.

    Raises:
        ConfigError: an unreadable file, a malformed override, an override into a non-table.
    """
    data: dict[str, typing.Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    for item in overrides:
        key, sep, raw = item.partition("=")
        *sections, leaf = key.strip().split(".")
        shape = "[section.]key=value" if top_level_keys else "section.key=value"
        _require(
            bool(sep and leaf) and (bool(sections) or top_level_keys), f"override must look like {shape}, got {item!r}"
        )
        node = data
        for name in sections:
            node = node.setdefault(name, {})
            _require(isinstance(node, dict), f"{key}: {name} is not a section")
        node[leaf] = _parse_scalar(raw.strip())
    return data


def _parse_scalar(raw: str) -> object:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


T = typing.TypeVar("T")


def build_dataclass(cls: type[T], data: typing.Mapping[str, typing.Any], where: str) -> T:
    """Instantiate dataclass `cls` from a mapping, recursing into nested dataclasses."""
    _require(isinstance(data, dict), f"{where or 'config'} must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    _require(not unknown, f"unknown key(s) {unknown} in {where or 'config'}; valid: {sorted(names)}")
    kwargs: dict[str, object] = {}
    for name, value in data.items():
        kind = hints[name]
        dotted = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(kind):
            kwargs[name] = build_dataclass(typing.cast(type, kind), value, dotted)
        else:
            kwargs[name] = _coerce(kind, value, dotted)
    return cls(**kwargs)


def _coerce(kind: object, value: object, where: str) -> object:
    if get_origin(kind) is Literal:
        _require(value in get_args(kind), f"{where} must be one of {get_args(kind)}, got {value!r}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float, str, bool):
        ok = isinstance(value, typing.cast(type, kind)) and not (kind is int and isinstance(value, bool))
        _require(ok, f"{where} must be {typing.cast(type, kind).__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported config type {kind}")
