"""Finding peers: segment name -> descriptor, from a metadata backend or by handshake.

With a backend, owners publish their descriptor under `tsukimi/segments/<name>` on every
change and peers fetch it. In p2p mode there is no service: a segment's name is its
server's `host:port`, and peers exchange descriptors in a handshake on that port (each side
learns the other's). Descriptors are cached; the engine re-fetches one when a request falls
outside every buffer it knows, which is how a buffer registered later reaches peers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec

from tsukimi.errors import ConfigError, MetadataError, ProtocolError, SegmentNotFound
from tsukimi.transfer.metadata import SEGMENT_PREFIX, MetadataBackend
from tsukimi.transfer.segment import Endpoint, SegmentDescriptor, decode_descriptor, encode_descriptor
from tsukimi.transfer.transports import tcp

logger = logging.getLogger(__name__)

MAX_CACHED_SEGMENTS = 65536


def parse_host_port(name: str) -> Endpoint:
    """`host:port` -> Endpoint. Raises ConfigError for anything else."""
    host, sep, port = name.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"in p2p mode a segment name is host:port, got {name!r}")
    return Endpoint(host.strip("[]"), int(port))


class SegmentDirectory:
    """Resolves and caches peers' descriptors. Thread-safe."""

    def __init__(
        self,
        backend: MetadataBackend | None,
        mine: Callable[[], bytes],
        timeout_s: float,
        secret: bytes | None = None,
    ) -> None:
        self._backend = backend
        self._secret = secret
        self._mine = mine
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cache: dict[str, SegmentDescriptor] = {}

    @property
    def p2p(self) -> bool:
        return self._backend is None

    def publish(self, desc: SegmentDescriptor) -> None:
        """Make our own descriptor visible (no-op in p2p mode). Raises MetadataError."""
        if self._backend is not None:
            self._backend.put(SEGMENT_PREFIX + desc.name, encode_descriptor(desc))

    def withdraw(self, name: str) -> None:
        if self._backend is not None:
            self._backend.delete(SEGMENT_PREFIX + name)

    def get(self, name: str) -> SegmentDescriptor:
        """The cached descriptor of `name`, fetched on first use. Raises SegmentNotFound."""
        desc = self._cache.get(name)
        return desc if desc is not None else self.fetch(name)

    def fetch(self, name: str) -> SegmentDescriptor:
        """Fetch `name`'s current descriptor, bypassing the cache (updates it).

        Raises:
            SegmentNotFound: not published, or (p2p) not reachable.
            AuthError: (p2p) the cluster-secret handshake with the peer failed.
            ProtocolError: the descriptor is malformed.
            MetadataError: the metadata service failed.
        """
        if self._backend is None:
            endpoint = parse_host_port(name)
            try:
                raw = tcp.handshake(endpoint, self._mine(), self._timeout_s, self._secret)
            except OSError as exc:
                raise SegmentNotFound(f"segment {name} is not reachable: {exc}") from exc
        else:
            found = self._backend.get(SEGMENT_PREFIX + name)
            if found is None:
                raise SegmentNotFound(f"no segment named {name!r} is published")
            raw = found
        try:
            desc = decode_descriptor(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed descriptor for segment {name}: {exc}") from exc
        if desc.name != name:
            raise ProtocolError(f"asked for segment {name!r}, got the descriptor of {desc.name!r}")
        with self._lock:
            self._cache[name] = desc
        return desc

    def cached(self, name: str) -> SegmentDescriptor | None:
        """The descriptor of `name` if it is cached (never fetches)."""
        return self._cache.get(name)

    def learn_hint(self, desc: SegmentDescriptor) -> None:
        """Remember the descriptor a peer sent in its handshake (p2p mode only).

        NOTE: a hint never replaces a descriptor we fetched ourselves, and is ignored when a
        metadata service is the authority: otherwise any client of our segment server could
        redirect our writes for another peer's name. (Without the cluster secret, a local
        process can still pose as a peer we have not contacted yet; with it, only members of
        the cluster reach this point.)
        """
        if self._backend is not None:
            return
        with self._lock:
            if desc.name not in self._cache and len(self._cache) < MAX_CACHED_SEGMENTS:
                self._cache[desc.name] = desc

    def invalidate(self, name: str) -> None:
        """Forget the cached descriptor of `name`; the next use fetches it again."""
        with self._lock:
            self._cache.pop(name, None)

    def close(self) -> None:
        if self._backend is not None:
            try:
                self._backend.close()
            except MetadataError as exc:
                logger.debug("closing the metadata backend: %s", exc)
