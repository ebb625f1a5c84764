"""The metadata backends' common ground: the `MetadataBackend` protocol, the key and value
checks every backend runs before touching the network, and the descriptors' key prefix.
(Kept apart from the package's `connect_metadata` so that the backends never import it.)"""

from __future__ import annotations

from typing import Protocol

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
