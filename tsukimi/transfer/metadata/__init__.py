"""Where Transfer Engine segment descriptors are published: one small key/value interface.

Backends: `MemoryMetadata` (in-process, tests), `HttpMetadata` (the embedded
`tsukimi metadata-server`, Mooncake's /metadata?key= protocol), `EtcdMetadata` (a real etcd
through etcd3gw). The fourth mode, "p2p", has no backend at all: peers exchange descriptors
in a handshake on the TCP transport (see `tsukimi.transfer.directory`).
"""

from __future__ import annotations

from tsukimi.config import MetadataConfig
from tsukimi.transfer.metadata.base import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    SEGMENT_PREFIX,
    MetadataBackend,
    check_key,
    check_value,
)

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "SEGMENT_PREFIX",
    "MetadataBackend",
    "check_key",
    "check_value",
    "connect_metadata",
]


def connect_metadata(config: MetadataConfig, secret: bytes | None = None) -> MetadataBackend | None:
    """Open the backend named by `config.url`; None for "p2p" (handshake mode). `secret`
    signs every request to an HTTP metadata server (etcd has its own authentication).

    Raises:
        ConfigError: malformed URL.
    """
    url = config.url
    if url == "p2p":
        return None
    if url.startswith("memory://"):
        from tsukimi.transfer.metadata.memory import MemoryMetadata

        return MemoryMetadata.named(url.removeprefix("memory://"))
    if url.startswith("http://"):
        from tsukimi.transfer.metadata.http_client import HttpMetadata

        return HttpMetadata(url, timeout_s=config.timeout_s, secret=secret)
    from tsukimi.transfer.metadata.etcd import EtcdMetadata

    return EtcdMetadata.from_url(url, timeout_s=config.timeout_s)
