"""The metadata backends' common ground: the `MetadataBackend` protocol, the key and value
checks every backend runs before touching the network, and the descriptors' key prefix.
(Kept apart from the package's `connect_metadata` so that the backends never import it.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tsukimi.errors import ConfigError

SEGMENT_PREFIX = "tsukimi/segments/"
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 16 << 20
MAX_LIST_KEYS = 10_000
MIN_TTL_S = 0.1
MAX_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class Versioned:
    """A value and the revision it was written at: > 0, and different after every write of the
    key (etcd's mod_revision; the embedded server's ETag). Compare-and-set takes it back."""

    value: bytes
    revision: int


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

    def get_versioned(self, key: str) -> Versioned | None:
        """The value under `key` with its revision, or None when there is none."""
        ...

    def compare_and_set(self, key: str, value: bytes, expected_revision: int) -> int:
        """Store `value` only if `key` is still at `expected_revision` (0: only if the key does
        not exist); returns the new revision. Raises RevisionConflict otherwise (nothing written)."""
        ...

    def compare_and_delete(self, key: str, expected_revision: int) -> None:
        """Remove `key` only if it is still at `expected_revision` (> 0). Raises RevisionConflict
        otherwise (a missing key is a conflict too: someone else removed it)."""
        ...

    def list_prefix(self, prefix: str) -> dict[str, Versioned]:
        """Every key starting with `prefix` (non-empty), at most MAX_LIST_KEYS of them (more is a
        MetadataError), with values and revisions; expired ephemeral keys are not listed."""
        ...

    def put_ephemeral(self, key: str, value: bytes, ttl_s: float) -> None:
        """Store `value` under `key` until `ttl_s` seconds (MIN_TTL_S..MAX_TTL_S) after the last
        put_ephemeral of that key by this handle; then it vanishes (etcd: a lease this handle
        keeps and refreshes; the embedded server and memory: an expiry time). A holder that
        dies stops refreshing, so its keys go. Calling it again refreshes (and may change the
        value). A plain `put` or `delete` of the key ends its ephemerality."""
        ...

    def close(self) -> None:
        """Release connections (and revoke this handle's ephemeral keys where the backend can);
        further calls raise ClosedError."""
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


def check_prefix(prefix: str) -> bytes:
    """Validate a list prefix (as a key, non-empty). Raises ConfigError."""
    return check_key(prefix)


def check_revision(revision: int, *, allow_zero: bool) -> None:
    """Raises ConfigError: `revision` is not an int >= 0 (>= 1 unless `allow_zero`)."""
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < (0 if allow_zero else 1):
        low = 0 if allow_zero else 1
        raise ConfigError(f"expected revision must be an int >= {low}, got {revision!r}")


def check_ttl(ttl_s: float) -> None:
    """Raises ConfigError: `ttl_s` is not a number in [MIN_TTL_S, MAX_TTL_S]."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        raise ConfigError(f"ttl_s must be a number in [{MIN_TTL_S}, {MAX_TTL_S}], got {ttl_s!r}")
