"""What Mooncake's `TransferEngine.initialize(local_hostname, metadata_server, protocol,
device_name)` (and `initialize_ext`, which adds the metadata type) mean for a tsukimi engine:
its segment name, the address it serves on, where it publishes, and which transports it uses.

| Mooncake argument                       | tsukimi                                                |
|-----------------------------------------|--------------------------------------------------------|
| local_hostname "host" / "host:port"     | transfer.bind_host = host                              |
| metadata_server "P2PHANDSHAKE" (or "")  | metadata p2p; the name is the server's host:port, on   |
|                                         | `port` when given (Mooncake's P2P mode)                |
| metadata_server "http://..."/"etcd://..."| metadata.url as is; the name is local_hostname; an     |
|                                         | ephemeral port (published, as Mooncake's RPC mapping)  |
| metadata_server "host:port[/path]"      | etcd://host:port, or metadata_type://... (initialize_ext)|
| protocol "tcp"                          | transfer.transport auto: shm or cma with a peer on     |
|                                         | this host, tcp otherwise                               |
| protocol "rdma"                         | auto with the nixl transport on (`make nixl`); tcp,    |
|                                         | with one warning, where NIXL is not installed (rdma.py)|
| device_name                             | unused (NIXL/UCX choose the NICs)                      |

`started(engine)` is how every part of the facade asks for the engine `initialize` started.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tsukimi.compat.mooncake.rdma import rdma_uses_nixl
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError
from tsukimi.transfer import TransferEngine

P2P = "P2PHANDSHAKE"
DEFAULT_HOST = "127.0.0.1"
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """The engine `initialize` asks for: `name` is None in p2p mode (the server's address)."""

    name: str | None
    config: Config


def engine_setup(local_hostname: str, metadata_server: str, protocol: str, metadata_type: str = "") -> EngineSetup:
    """Map `initialize`'s arguments (pure).

    Raises:
        ConfigError: an unknown protocol or metadata scheme (naming the valid ones), a bad port.
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    host, port = _host_port(local_hostname)
    p2p = metadata_server.strip().upper() in (P2P, "")
    transfer = TransferConfig(bind_host=host, port=port if p2p else 0, nixl=protocol == "rdma" and rdma_uses_nixl())
    config = replace(
        Config(), transfer=transfer, metadata=MetadataConfig(url="p2p" if p2p else _url(metadata_server, metadata_type))
    )
    return EngineSetup(None if p2p else local_hostname or host, config)


def _host_port(local_hostname: str) -> tuple[str, int]:
    """("host", port) of "host", "host:port" or "[v6]:port" (port 0 when absent)."""
    host, sep, port = local_hostname.rpartition(":")
    if not sep or (":" in host and not host.startswith("[")):  # no port, or a bare IPv6 address
        return (local_hostname.strip("[]") or DEFAULT_HOST), 0
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"local_hostname must be host or host:port, got {local_hostname!r}")
    return (host.strip("[]") or DEFAULT_HOST), int(port)


def _url(metadata_server: str, metadata_type: str) -> str:
    """A metadata URL: as given with a scheme; otherwise `metadata_type://`, etcd by default
    (Mooncake reads a bare host:port as an etcd address)."""
    if "://" in metadata_server:
        return metadata_server
    return f"{metadata_type.strip().lower() or 'etcd'}://{metadata_server}"


def started(engine: TransferEngine | None) -> TransferEngine:
    """`engine`, the one `initialize` started. Raises ConfigError when there is none (before
    initialize, after close)."""
    if engine is None:
        raise ConfigError("TransferEngine: call initialize() first")
    return engine
