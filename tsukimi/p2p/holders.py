"""Holder liveness: each P2P store keeps an ephemeral key under HOLDER_PREFIX + its segment,
and readers trust only the copies of segments whose key is there.

The key lives `ttl_s` after its last refresh (an etcd lease, an expiry on the embedded
server); a thread refreshes it every third of that. A holder that dies stops refreshing, so
within `ttl_s` readers stop choosing its copies, and the next compare-and-set on a record
prunes them. A refresh that fails (metadata service down) is logged and retried: the key may
lapse meanwhile, which only hides this holder's copies for a while.
"""

from __future__ import annotations

import logging
import os
import threading

from tsukimi.errors import TsukimiError
from tsukimi.p2p.records import HOLDER_PREFIX, HolderRecord, decode_holder, encode
from tsukimi.transfer.metadata import MetadataBackend

logger = logging.getLogger(__name__)


def live_holders(metadata: MetadataBackend) -> dict[str, HolderRecord]:
    """Segment -> holder record of every live holder (one prefix listing).

    Raises:
        MetadataError: the metadata service failed.
    """
    found: dict[str, HolderRecord] = {}
    for key, entry in metadata.list_prefix(HOLDER_PREFIX).items():
        record = decode_holder(entry.value)
        if record is not None:
            found[key.removeprefix(HOLDER_PREFIX)] = record
    return found


class HolderBeacon:
    """This store's liveness key (thread-safe). `update` changes what it advertises and
    refreshes at once; a daemon thread refreshes every `ttl_s / 3`; `close` deletes it."""

    def __init__(self, metadata: MetadataBackend, segment: str, ttl_s: float) -> None:
        self._metadata = metadata
        self._key = HOLDER_PREFIX + segment
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._holding: set[str] = set()
        self._fetching: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, *, holding: set[str], fetching: set[str]) -> None:
        """Advertise these payloads; starts the refresher on first use.

        Raises:
            MetadataError / AuthError: the first refresh failed (the caller's operation
                cannot be announced).
        """
        with self._lock:
            self._holding, self._fetching = set(holding), set(fetching)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name=f"p2p-beacon {self._key}", daemon=True)
                self._thread.start()
        self._refresh()

    def _value(self) -> bytes:
        with self._lock:
            record = HolderRecord(pid=os.getpid(), holding=sorted(self._holding), fetching=sorted(self._fetching))
        return encode(record)

    def _refresh(self) -> None:
        self._metadata.put_ephemeral(self._key, self._value(), self._ttl_s)

    def _run(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            try:
                self._refresh()
            except TsukimiError as exc:
                logger.warning("could not refresh P2P holder key %s (retrying): %s", self._key, exc)

    def close(self) -> None:
        """Stop refreshing and delete the key (best effort); idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join(timeout=5.0)
        try:
            self._metadata.delete(self._key)
        except TsukimiError as exc:
            logger.warning("could not delete P2P holder key %s (it expires by itself): %s", self._key, exc)
