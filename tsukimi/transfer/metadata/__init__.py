"""Where Transfer Engine segment descriptors are published: one small key/value interface.

Backends: `MemoryMetadata` (in-process, tests), `HttpMetadata` (the embedded
`tsukimi metadata-server`, Mooncake's /metadata?key= protocol), `EtcdMetadata` (a real etcd
through etcd3gw). The fourth mode, "p2p", has no backend at all: peers exchange descriptors
in a handshake on the TCP transport (see `tsukimi.transfer.directory`).
"""

from __future__ import annotations

from typing import Protocol

from tsukimi.config import MetadataConfig
from tsukimi.errors import ConfigError

SEGMENT_PREFIX = "tsukimi/segments/"
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 16 << 20


class MetadataBackend(Protocol):
    """A key/value store for descriptors. Every call has a timeout; failures raise MetadataError."""

    def get(self, key: str) -> bytes | None:
        """The value stored under `key`, or None when there is none."""
        ...

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, replacing any earlier value."""
        ...

    def delete(self, key: str) -> None:
        """Remove `key`; removing a missing key is not an error."""
        ...

    def close(self) -> None:
        """Release connections; further calls raise ClosedError."""
        ...


def check_key(key: str) -> bytes:
    """Validate a metadata key; every backend calls this before touching the network.

    Returns:
        The key encoded as UTF-8.
    Raises:
        ConfigError: the key is not a non-empty str of at most MAX_KEY_BYTES UTF-8 bytes.
    """
    if not isinstance(key, str) or not key:
        raise ConfigError(f"metadata key must be a non-empty str, got {key!r}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"metadata key is not valid unicode: {key!r}") from exc
    if len(raw) > MAX_KEY_BYTES:
        raise ConfigError(f"metadata key is {len(raw)} bytes, the limit is {MAX_KEY_BYTES}")
    return raw


def check_value(value: bytes) -> None:
    """Validate a metadata value.

    Raises:
        ConfigError: the value is not bytes-like or is larger than MAX_VALUE_BYTES.
    """
    if not isinstance(value, (bytes, bytearray)):
        raise ConfigError(f"metadata value must be bytes, got {type(value).__name__}")
    if len(value) > MAX_VALUE_BYTES:
        raise ConfigError(f"metadata value is {len(value)} bytes, the limit is {MAX_VALUE_BYTES}")


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
        from tsukimi.transfer.metadata.http import HttpMetadata

        return HttpMetadata(url, timeout_s=config.timeout_s, secret=secret)
    from tsukimi.transfer.metadata.etcd import EtcdMetadata

    return EtcdMetadata.from_url(url, timeout_s=config.timeout_s)
