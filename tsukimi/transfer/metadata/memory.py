"""In-process metadata backend: a locked dict, optionally shared by name across handles.

`MemoryMetadata()` owns a private store. `MemoryMetadata.named(name)` returns a *new handle*
over a process-wide store registered under `name`, so several Transfer Engines in one
process (the `memory://NAME` URL) see each other's descriptors. Closing a handle only closes
that handle; the shared store lives on for the other handles until `discard_named(name)`.

    handle A --\\
                >-- _Store("demo") {key: bytes}   (one lock per store)
    handle B --/
"""

from __future__ import annotations

import itertools
import logging
import threading

from tsukimi.clock import Clock, WallClock
from tsukimi.errors import ClosedError, MetadataError, RevisionConflict
from tsukimi.transfer.metadata.base import (
    MAX_LIST_KEYS,
    Versioned,
    check_key,
    check_prefix,
    check_revision,
    check_ttl,
    check_value,
)

logger = logging.getLogger(__name__)


class _Store:
    """The dict behind one or more handles; every access holds `lock`. `data` maps a key to
    its value and revision; `expiry` holds the deadline of ephemeral keys (the clock's time).
    Revisions come from one counter per store, so a rewritten key never repeats one."""

    __slots__ = ("clock", "data", "expiry", "lock", "name", "revisions")

    def __init__(self, name: str, clock: Clock | None = None) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.clock: Clock = clock or WallClock()
        self.data: dict[str, Versioned] = {}
        self.expiry: dict[str, float] = {}
        self.revisions = itertools.count(1)

    def live(self, key: str) -> Versioned | None:
        """The entry of `key` unless it expired (dropped then); call under `lock`."""
        deadline = self.expiry.get(key)
        if deadline is not None and self.clock.now() >= deadline:
            del self.expiry[key]
            del self.data[key]
            return None
        return self.data.get(key)

    def expect(self, key: str, expected_revision: int) -> None:
        """Raises RevisionConflict unless `key` is at `expected_revision` (0: absent); under `lock`."""
        current = self.live(key)
        found = 0 if current is None else current.revision
        if found != expected_revision:
            raise RevisionConflict(f"metadata key {key!r} is at revision {found}, not {expected_revision}")

    def write(self, key: str, value: bytes, ttl_s: float | None = None) -> int:
        """Store `value` at a fresh revision (ephemeral for `ttl_s`); call under `lock`."""
        revision = next(self.revisions)
        self.data[key] = Versioned(bytes(value), revision)
        if ttl_s is None:
            self.expiry.pop(key, None)
        else:
            self.expiry[key] = self.clock.now() + ttl_s
        return revision


_registry: dict[str, _Store] = {}
_registry_lock = threading.Lock()


class MemoryMetadata:
    """A `MetadataBackend` kept in this process's memory; thread-safe, never times out."""

    def __init__(self, clock: Clock | None = None) -> None:
        """A handle over a fresh private store (not reachable through `named`); `clock` times
        ephemeral keys (a VirtualClock in tests)."""
        self._store = _Store("", clock)
        self._closed = False

    @classmethod
    def named(cls, name: str) -> MemoryMetadata:
        """A new handle over the process-wide store called `name`, created on first use.

        Mutates the process-wide registry when `name` is new.
        """
        with _registry_lock:
            store = _registry.get(name)
            if store is None:
                store = _registry[name] = _Store(name)
                logger.debug("created shared metadata store %r", name)
        handle = cls()
        handle._store = store
        return handle

    @staticmethod
    def discard_named(name: str) -> None:
        """Forget the shared store `name`; open handles keep their (now private) data.

        A later `named(name)` starts empty. Discarding an unknown name is not an error.
        """
        with _registry_lock:
            _registry.pop(name, None)

    @property
    def name(self) -> str:
        """The shared store's name; "" for a private store."""
        return self._store.name

    def get(self, key: str) -> bytes | None:
        """The value under `key`, or None.

        Raises:
            ClosedError: this handle was closed.
            ConfigError: invalid key.
        """
        self._check_open()
        check_key(key)
        with self._store.lock:
            entry = self._store.live(key)
        return None if entry is None else entry.value

    def get_versioned(self, key: str) -> Versioned | None:
        """The value under `key` with its revision, or None.

        Raises:
            ClosedError, ConfigError (invalid key).
        """
        self._check_open()
        check_key(key)
        with self._store.lock:
            return self._store.live(key)

    def compare_and_set(self, key: str, value: bytes, expected_revision: int) -> int:
        """Store `value` if `key` is at `expected_revision` (0: absent); the new revision
        (mutates the store).

        Raises:
            ClosedError, ConfigError (invalid key, value or revision), RevisionConflict.
        """
        self._check_open()
        check_key(key)
        check_value(value)
        check_revision(expected_revision, allow_zero=True)
        with self._store.lock:
            self._store.expect(key, expected_revision)
            return self._store.write(key, value)

    def compare_and_delete(self, key: str, expected_revision: int) -> None:
        """Remove `key` if it is at `expected_revision` (mutates the store).

        Raises:
            ClosedError, ConfigError (invalid key or revision), RevisionConflict (another
            revision, or no key).
        """
        self._check_open()
        check_key(key)
        check_revision(expected_revision, allow_zero=False)
        with self._store.lock:
            self._store.expect(key, expected_revision)
            del self._store.data[key]
            self._store.expiry.pop(key, None)

    def list_prefix(self, prefix: str) -> dict[str, Versioned]:
        """Every live key starting with `prefix`, with its value and revision.

        Raises:
            ClosedError, ConfigError (invalid prefix), MetadataError (over MAX_LIST_KEYS keys).
        """
        self._check_open()
        check_prefix(prefix)
        with self._store.lock:
            found = {}
            for key in [k for k in self._store.data if k.startswith(prefix)]:
                entry = self._store.live(key)
                if entry is not None:
                    found[key] = entry
        if len(found) > MAX_LIST_KEYS:
            raise MetadataError(f"{len(found)} keys start with {prefix!r}; the limit is {MAX_LIST_KEYS}")
        return found

    def put_ephemeral(self, key: str, value: bytes, ttl_s: float) -> None:
        """Store `value` under `key` until `ttl_s` seconds from now unless refreshed (mutates).

        Raises:
            ClosedError, ConfigError (invalid key, value or ttl).
        """
        self._check_open()
        check_key(key)
        check_value(value)
        check_ttl(ttl_s)
        with self._store.lock:
            self._store.write(key, value, ttl_s)

    def put(self, key: str, value: bytes) -> None:
        """Store a copy of `value` under `key`, replacing any earlier value (mutates the store).

        Raises:
            ClosedError: this handle was closed.
            ConfigError: invalid key or oversized value.
        """
        self._check_open()
        check_key(key)
        check_value(value)
        with self._store.lock:
            self._store.write(key, value)

    def delete(self, key: str) -> None:
        """Remove `key` if present (mutates the store).

        Raises:
            ClosedError: this handle was closed.
            ConfigError: invalid key.
        """
        self._check_open()
        check_key(key)
        with self._store.lock:
            self._store.data.pop(key, None)
            self._store.expiry.pop(key, None)

    def keys(self) -> list[str]:
        """A sorted snapshot of the keys in the store (for debugging and tests).

        Raises:
            ClosedError: this handle was closed.
        """
        self._check_open()
        with self._store.lock:
            return sorted(key for key in list(self._store.data) if self._store.live(key) is not None)

    def close(self) -> None:
        """Close this handle only; idempotent. Other handles of the same name keep working."""
        self._closed = True

    def __enter__(self) -> MemoryMetadata:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("MemoryMetadata handle is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"MemoryMetadata(name={self._store.name!r}, {state})"
