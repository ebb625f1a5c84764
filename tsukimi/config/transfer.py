"""How bytes move and who may move them: the Transfer Engine (`TransferConfig`), where segment
descriptors are published (`MetadataConfig`) and the optional cluster secret
(`SecurityConfig`), the `[transfer]`, `[metadata]` and `[security]` tables of `Config`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tsukimi.config.loader import require
from tsukimi.errors import ConfigError

MIB = 1 << 20
SECRET_ENV = "TSUKIMI_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Transfer Engine settings.

    transport: "auto" gives each request to the first registered transport, by rank, that can
        serve it (shm for shared-memory buffers of a peer on this host, cma for any other
        memory of one, tcp otherwise); a transport's name ("shm", "cma", "tcp", ...) forces
        it (a request it cannot serve fails). The engine checks the name against the
        transports registered (tsukimi/transfer/transports/).
    num_connections: parallel TCP connections per peer that large transfers are striped over.
    slice_bytes: requests larger than this are split into slices of this size.
    timeout_s: default deadline of a request, from submission to completion.
    bind_host: the address the segment server listens on; several, comma-separated, for
        several NICs ("10.0.0.5,10.0.1.5"): the engine serves on each and publishes them all,
        and tcp peers stripe over them and retry a broken path on another.
    stall_s: a tcp connection with slices in flight that neither receives nor has a byte
        acknowledged for this long, while another path to the same peer progressed, is
        broken and its slices retried on another path (a NIC that died silently; much longer
        silence breaks it also with no other path: transports/tcp_stall.py). A few RTTs at
        least; a false positive costs a resend.
    nixl: turn on the optional NIXL transport (RDMA NICs through UCX; `make nixl` installs
        it; docs/rdma.md). nixl_staging_bytes: its registered bounce buffer for local memory
        that is not registered with the engine.
    """

    transport: str = "auto"
    bind_host: str = "127.0.0.1"
    port: int = 0
    num_connections: int = 4
    slice_bytes: int = 2 * MIB
    max_slice_bytes: int = 64 * MIB
    pipeline_depth: int = 8
    timeout_s: float = 30.0
    connect_timeout_s: float = 3.0
    max_retries: int = 2
    stall_s: float = 0.5
    num_shm_workers: int = 2
    max_server_connections: int = 256
    shm_dir: str = "/dev/shm"
    nixl: bool = False
    nixl_staging_bytes: int = 16 * MIB

    @property
    def bind_hosts(self) -> tuple[str, ...]:
        """The addresses in `bind_host` (one server each)."""
        return tuple(host.strip() for host in self.bind_host.split(","))

    def __post_init__(self) -> None:
        require(
            self.transport.isidentifier(),
            f"transfer.transport must be auto or a transport's name, got {self.transport!r}",
        )
        require(0 <= self.port <= 65535, f"transfer.port must be in 0..65535, got {self.port}")
        require(
            all(self.bind_hosts) and len(set(self.bind_hosts)) == len(self.bind_hosts),
            f"transfer.bind_host must be addresses separated by commas, none twice, got {self.bind_host!r}",
        )
        require(1 <= self.num_connections <= 64, "transfer.num_connections must be in 1..64")
        require(
            4096 <= self.slice_bytes <= self.max_slice_bytes,
            f"transfer.slice_bytes must be in 4096..max_slice_bytes ({self.max_slice_bytes})",
        )
        require(self.max_slice_bytes <= 1 << 30, "transfer.max_slice_bytes must be <= 1 GiB")
        require(1 <= self.pipeline_depth <= 64, "transfer.pipeline_depth must be in 1..64")
        require(self.timeout_s > 0, "transfer.timeout_s must be > 0")
        require(self.nixl_staging_bytes >= 1 * MIB, "transfer.nixl_staging_bytes must be >= 1 MiB")
        require(self.connect_timeout_s > 0, "transfer.connect_timeout_s must be > 0")
        require(0 <= self.max_retries <= 16, "transfer.max_retries must be in 0..16")
        require(0.1 <= self.stall_s <= 3600, f"transfer.stall_s must be in 0.1..3600 s, got {self.stall_s}")
        require(1 <= self.num_shm_workers <= 64, "transfer.num_shm_workers must be in 1..64")
        require(self.max_server_connections >= 1, "transfer.max_server_connections must be >= 1")


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
        require(
            ok,
            f"metadata.url must be p2p, memory://NAME, http://HOST:PORT/PATH or "
            f"etcd://HOST:PORT[,...], got {self.url!r}",
        )
        require(self.timeout_s > 0, "metadata.timeout_s must be > 0")


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
        raw = os.environ.get(SECRET_ENV)
        if raw is None and self.secret_file:
            try:
                raw = Path(self.secret_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read security.secret_file {self.secret_file}: {exc}") from exc
        if not raw:
            return None
        secret = raw.encode()
        require(len(secret) >= MIN_SECRET_BYTES, f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        return secret
