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

import logging
import threading

from tsukimi.errors import ClosedError
from tsukimi.transfer.metadata.base import check_key, check_value

logger = logging.getLogger(__name__)


class _Store:
    """The dict behind one or more handles; every access holds `lock`."""

    __slots__ = ("data", "lock", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.data: dict[str, bytes] = {}


_registry: dict[str, _Store] = {}
_registry_lock = threading.Lock()


class MemoryMetadata:
    """A `MetadataBackend` kept in this process's memory; thread-safe, never times out."""

    def __init__(self) -> None:
        """A handle over a fresh private store (not reachable through `named`)."""
        self._store = _Store("")
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
            return self._store.data.get(key)

    def put(self, key: str, value: bytes) -> None:
        """Store a copy of `value` under `key`, replacing any earlier value (mutates the store).

        Raises:
            ClosedError: this handle was closed.
            ConfigError: invalid key or oversized value.
        """
        self._check_open()
        check_key(key)
        check_value(value)
        data = bytes(value)
        with self._store.lock:
            self._store.data[key] = data

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

    def keys(self) -> list[str]:
        """A sorted snapshot of the keys in the store (for debugging and tests).

        Raises:
            ClosedError: this handle was closed.
        """
        self._check_open()
        with self._store.lock:
            return sorted(self._store.data)

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
