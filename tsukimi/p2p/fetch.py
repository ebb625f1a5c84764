"""Pulling a payload's shards: which shard next, from which holder, and what a failure costs.

`ShardFetch.run` starts `max_inflight` threads. Each takes the next shard and READs it with
the Transfer Engine straight into the caller's buffers:

- next shard: one that some other reader already holds (picked at random among those,
  preferring one a holder this reader reads nothing from right now has, so that its reads in
  flight come from different holders' links), so the origin is left for shards nobody has
  yet. Those origin-only shards are dealt out among the readers fetching the payload (each
  sees the others' holder keys): a reader pulls its own share from the origin and waits for
  the replicas of the rest (the BitTorrent-like fan-out: the origin serves each shard about
  once). The readers share `max_inflight` origin pulls between them (each at least one at a
  time): a reader pulling all its share at once would finish every shard at the end, leaving
  the others nothing to relay until then. A reader that has waited STALL_S with nothing new
  appearing pulls from the origin anyway (an owner that died or stalled);
- source: a live holder of that shard that this reader reads least from right now (at random
  among those; another reader first, the origin's gold copy as the fallback), never one that
  already failed this shard;
- every shard's crc32c is checked (`verify`); a mismatch counts as that holder failing;
- a failed attempt tries another holder, up to max(3, holders) attempts per shard;
- each verified shard is announced (`announce(index)`) so later readers pull from here.

The record and the live holders are re-read at most every `REFRESH_S` (at once after a
failure). The first error that ends the fetch (a shard out of attempts, the payload
unregistered) stops the other threads after their current shard and is raised by `run`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tsukimi.config import P2PConfig
from tsukimi.errors import ChecksumMismatch, PayloadNotFound, TooManyRetries, TsukimiError
from tsukimi.p2p.buffers import crc32c_of
from tsukimi.p2p.holders import live_holders
from tsukimi.p2p.records import (
    Extent,
    HolderRecord,
    Location,
    PayloadRecord,
    decode_record,
    map_range,
    payload_key,
    pieces,
)
from tsukimi.transfer import OpCode, TransferEngine, TransferRequest
from tsukimi.transfer.metadata import MetadataBackend

logger = logging.getLogger(__name__)

REFRESH_S = 0.05
WAIT_S = 0.02
STALL_S = 2.0  # waiting this long for a replica that does not come: pull from the origin


@dataclass(slots=True)
class P2PStats:
    """Counters of one P2P store (thread-safe through `add`). Where a fetch's time goes, in
    thread-seconds summed over its fetch threads: `read_s` reading shards (and checking their
    crc32c), `announce_s` adding verified shards to the record, `idle_s` waiting for a shard
    to become fetchable (owned by another reader and not relayed yet)."""

    bytes_fetched: int = 0
    bytes_from_gold: int = 0
    bytes_from_replicas: int = 0
    retries: int = 0
    crc_failures: int = 0
    read_s: float = 0.0
    announce_s: float = 0.0
    idle_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


class RecordView:
    """The payload's current record and the live holders, cached for REFRESH_S."""

    def __init__(self, metadata: MetadataBackend, name: str, registration: str) -> None:
        self._metadata = metadata
        self._key = payload_key(name)
        self.name = name
        self.registration = registration
        self._lock = threading.Lock()
        self._at = -1.0
        self._record: PayloadRecord | None = None
        self._live: dict[str, HolderRecord] = {}

    def current(self, *, fresh: bool = False) -> tuple[PayloadRecord, dict[str, HolderRecord]]:
        """Raises PayloadNotFound (unregistered, or registered again), MetadataError."""
        with self._lock:
            if fresh or self._record is None or time.monotonic() - self._at > REFRESH_S:
                entry = self._metadata.get_versioned(self._key)
                record = decode_record(entry.value) if entry is not None else None
                if record is None or record.registration != self.registration:
                    raise PayloadNotFound(f"P2P payload {self.name!r} was unregistered during the fetch")
                self._record, self._live, self._at = record, live_holders(self._metadata), time.monotonic()
            return self._record, self._live


class ShardFetch:
    """One `get_replica`'s pull of every shard into `local` (the reader's extents)."""

    def __init__(
        self,
        engine: TransferEngine,
        config: P2PConfig,
        view: RecordView,
        local: Sequence[Extent],
        announce: Callable[[int], None],
        stats: P2PStats,
    ) -> None:
        self._engine, self._config, self._view, self._local = engine, config, view, tuple(local)
        self._announce, self._stats, self._self = announce, stats, engine.name
        record, _ = view.current()
        self._remaining = set(range(len(record.shards)))
        self._gold_inflight = 0
        self._reading: Counter[str] = Counter()  # holder segment -> this fetch's reads from it in flight
        self._progress_at = time.monotonic()
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def run(self) -> None:
        """Fetch every shard; raises the first error that ended the fetch."""
        count = min(self._config.max_inflight, len(self._remaining))
        threads = [threading.Thread(target=self._worker, name=f"p2p-fetch-{i}", daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self._error is not None:
            raise self._error
        if self._remaining:  # NOTE: cannot happen without an error; a guard against silent loss
            raise TooManyRetries(f"P2P payload {self._view.name!r}: {len(self._remaining)} shards left unfetched")

    def _worker(self) -> None:
        while (picked := self._next()) is not None:
            index, from_gold = picked
            try:
                self._fetch(index)
            except BaseException as exc:  # NOTE: ends this fetch; run() raises it in the caller
                with self._cond:
                    self._error = self._error or exc
                    self._cond.notify_all()
                return
            finally:
                with self._cond:
                    self._gold_inflight -= from_gold
                    self._progress_at = time.monotonic()
                    self._cond.notify_all()

    def _next(self) -> tuple[int, bool] | None:
        """The next shard to fetch and whether only the origin had it; None when done."""
        with self._cond:
            while self._error is None and self._remaining:
                record, live = self._view.current()
                shared = [i for i in self._remaining if any(self._usable(r, live) for r in record.shards[i].replicas)]
                if shared:
                    self._progress_at = time.monotonic()
                    spread = [i for i in shared if any(self._idle(r, live) for r in record.shards[i].replicas)]
                    return self._take(random.choice(spread or shared), False)
                mine, fetchers = self._owned(sorted(self._remaining), live)
                if mine and self._gold_inflight < max(1, self._config.max_inflight // fetchers):
                    return self._take(random.choice(mine), True)
                if self._gold_inflight == 0 and time.monotonic() - self._progress_at > STALL_S:
                    return self._take(random.choice(sorted(self._remaining)), True)
                waited = time.monotonic()
                self._cond.wait(WAIT_S)
                self._stats.add(idle_s=time.monotonic() - waited)
            return None

    def _take(self, index: int, from_gold: bool) -> tuple[int, bool]:
        self._remaining.discard(index)
        self._gold_inflight += from_gold
        return index, from_gold

    def _owned(self, gold_only: list[int], live: dict[str, HolderRecord]) -> tuple[list[int], int]:
        """The origin-only shards this reader should pull, and how many readers fetch this
        payload: they (by segment name, as every one of them sees it) deal those shards out
        round-robin, so each leaves the origin about once; the others wait for its replica."""
        name = self._view.name
        fetchers = sorted({self._self, *(seg for seg, h in live.items() if name in h.fetching)})
        rank, count = fetchers.index(self._self), len(fetchers)
        return [i for i in gold_only if i % count == rank], count

    def _usable(self, location: Location, live: dict[str, HolderRecord]) -> bool:
        return location.segment != self._self and location.segment in live

    def _idle(self, location: Location, live: dict[str, HolderRecord]) -> bool:
        """A holder this fetch reads nothing from right now (call holding `_cond`)."""
        return self._usable(location, live) and not self._reading[location.segment]

    def _fetch(self, index: int) -> None:
        """Pull shard `index` from its holders until one copy verifies. Raises TooManyRetries."""
        tried: set[str] = set()
        reasons: list[str] = []
        fresh = False
        while True:
            record, live = self._view.current(fresh=fresh)
            shard = record.shards[index]
            holders = [r for r in shard.replicas if self._usable(r, live)]
            limit = max(3, len(holders) + 1)
            if len(reasons) >= limit:
                raise TooManyRetries(f"P2P shard {index} of {record.name!r} failed {len(reasons)} times", reasons)
            with self._cond:
                source = self._choose(shard.gold, holders, tried, self._reading)
                if source is not None:
                    self._reading[source.segment] += 1
            if source is None:  # every holder failed once: go round again after a pause
                tried.clear()
                time.sleep(0.1)
                continue
            local = map_range(self._local, shard.offset, shard.size)
            began = time.monotonic()
            try:
                error = self._read(source, local, shard.crc32c)
            finally:
                with self._cond:
                    self._reading[source.segment] -= 1
            read = time.monotonic()
            self._stats.add(read_s=read - began)
            if error is None:
                gold = source is shard.gold
                self._stats.add(
                    bytes_fetched=shard.size, **{"bytes_from_gold" if gold else "bytes_from_replicas": shard.size}
                )
                self._announce(index)
                self._stats.add(announce_s=time.monotonic() - read)
                return
            tried.add(source.segment)
            reasons.append(f"{source.segment}: {error}")
            self._stats.add(retries=1)
            logger.info(
                "P2P shard %d of %r from %s failed (%s); trying another holder",
                index,
                record.name,
                source.segment,
                error,
            )
            fresh = True

    @staticmethod
    def _choose(
        gold: Location, holders: list[Location], tried: set[str], reading: Mapping[str, int]
    ) -> Location | None:
        """A holder not tried yet for this shard: among the other readers, one this fetch
        reads least from right now (at random among those), else the origin's gold copy."""
        fresh = [h for h in holders if h.segment not in tried]
        if fresh:
            least = min(reading.get(h.segment, 0) for h in fresh)
            return random.choice([h for h in fresh if reading.get(h.segment, 0) == least])
        return gold if gold.segment not in tried else None

    def _read(self, source: Location, local: tuple[Extent, ...], expected_crc: int) -> TsukimiError | None:
        """READ one copy into `local` and check it; the error, or None when it verified."""
        requests = [
            TransferRequest(OpCode.READ, source.segment, remote, (address, length))
            for remote, address, length in pieces(source.extents, local)
        ]
        try:
            statuses = self._engine.transfer(requests, timeout_s=self._config.shard_timeout_s)
        except TsukimiError as exc:  # NOTE: e.g. SegmentNotFound: that holder's descriptor is gone
            return exc
        for status in statuses:
            if (error := status.error()) is not None:
                return error
        if self._config.verify:
            crc = crc32c_of(self._engine, local)
            if crc != expected_crc:
                self._stats.add(crc_failures=1)
                return ChecksumMismatch(f"crc32c {crc:#010x}, the record says {expected_crc:#010x}")
        return None
