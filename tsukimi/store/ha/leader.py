"""Leader election, fencing and the durable operation log of an HA master group, in etcd.

Keys, under /tsukimi/<cluster>/:
    leader            the leader's `LeaderInfo` (JSON), attached to its etcd lease
    log/<n:016x>      one log entry: the records of operations n, n+1, ... (journal.py)
    snap/<n:016x>/<i> chunk i of a snapshot of the state after operation n
    snapshot          {"upto": n, "chunks": k}: the snapshot to start from

Election: a master grants a lease of `ha_lease_ttl_s` and creates the leader key in a
transaction that requires it not to exist. The key's create revision is the leader's *term*.

Fencing: every write of a leader is a transaction that requires the leader key's create
revision to still be its term; once its lease expired (the key is gone, or a successor made
its own) nothing it writes lands. It also stops answering by itself: it serves only until
`valid_until` = (when the last successful keepalive was *sent*) + TTL - margin, which passes
before etcd (which counts from when it *received* it) expires the lease, so a paused or cut-off
leader stops before a successor can be elected. A monotonic clock keeps counting while a
process is stopped, so a SIGSTOPped leader that resumes finds itself expired at once.

Brief partitions: each keepalive (every TTL/4) goes out on a connection of its own, so one
lost in a cut does not hold back the next, which gets through as soon as the link heals; a
log commit etcd did not answer is put again, unchanged, while the lease holds (for at most
`ha_commit_timeout_s`, then the leader steps down). A cut under ~TTL/2 costs no failover.

Durability: the master appends the records of each operation under its lock (`append`
returns the operation's number) and answers only after `wait(n)`; an operation that changed
nothing (a read, a retry) waits for the last one appended (`barrier`), whose effects it may
have seen. A committer thread writes what accumulated in one guarded transaction (group
commit), in order, so an acknowledged operation and everything before it are in etcd. After
`ha_snapshot_records` records the committer writes a snapshot and drops the log entries it
covers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable

from tsukimi.clock import WallClock
from tsukimi.config import MasterConfig
from tsukimi.errors import MetadataError, NotLeader, ProtocolError
from tsukimi.store.ha import journal
from tsukimi.store.leader_record import LeaderInfo, leader_key
from tsukimi.transfer.metadata.etcd_kv import EtcdKV, Op, created_at, delete_op, prefix_end, put_op

logger = logging.getLogger(__name__)

MAX_ENTRY_BYTES = 1 << 20  # etcd refuses requests over 1.5 MiB by default
_POLL_S = 0.1  # how often a standby looks for a vacant leader key


class HAController:
    """Campaigns for leadership and keeps the log while leading (threads; `close()` to stop).

    Args:
        config: the master's settings (ha_etcd, ha_cluster, ha_lease_ttl_s, ...).
        info: what to publish as leader.
        elected: called (on the campaign thread) with the replayed tables once this master
            won; it must install the state before returning. Nothing is served before.
        deposed: called when leadership ended (the master drops its state).
        snapshot: returns (operation number, records) of the whole state, under the
            master's lock.
    """

    def __init__(
        self,
        config: MasterConfig,
        info: LeaderInfo,
        elected: Callable[[journal.Tables], None],
        deposed: Callable[[], None],
        snapshot: Callable[[], tuple[int, list[journal.Record]]],
    ) -> None:
        self.config = config
        self.info = info
        self.kv = EtcdKV(config.ha_etcd, timeout_s=min(2.0, config.ha_commit_timeout_s))
        self._elected, self._deposed, self._snapshot = elected, deposed, snapshot
        self._prefix = f"/tsukimi/{config.ha_cluster}/".encode()
        self._leader_key = leader_key(config.ha_cluster)
        self._clock = WallClock()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.term = 0  # create revision of our leader key; 0: not leading
        self._lease = 0
        self.valid_until = 0.0
        self._queue: list[tuple[int, list[journal.Record]]] = []
        self._appended = 0  # number of the last operation appended
        self._durable = 0  # number of the last operation in etcd
        self._since_snapshot = 0
        self._failing_since: float | None = None  # when log commits began to fail (None: they work)
        self.takeovers = 0
        self._thread = threading.Thread(target=self._run, name="tsukimi-master-ha", daemon=True)
        self._keeper = threading.Thread(target=self._keepalive_loop, name="tsukimi-master-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._keeper.start()

    # -- called by the master ---------------------------------------------------------

    @property
    def appended(self) -> int:
        """The number of the last operation appended (read it under the master's lock)."""
        return self._appended

    def leading(self) -> bool:
        """Whether this master may answer now (its term is on and its lease surely valid)."""
        return self.term != 0 and self._clock.now() < self.valid_until

    def append(self, records: list[journal.Record]) -> tuple[int, int]:
        """Queue one operation's records (caller holds the master lock); (term, its number)."""
        with self._cond:
            self._appended += 1
            self._queue.append((self._appended, records))
            self._cond.notify_all()
            return self.term, self._appended

    def barrier(self) -> tuple[int, int]:
        """(term, the number of the last operation appended): what an answer that changed
        nothing has seen (caller holds the master lock); `wait` on it before answering. NOTE:
        a retried request (a PutStart of the same put id, a second PutEnd) or a read finds in
        memory what an operation still waiting for etcd changed; answered at once, it would
        acknowledge what a successor, replaying the log, never sees."""
        with self._cond:
            return self.term, self._appended

    def wait(self, term: int, number: int) -> None:
        """Block until operation `number` of `term` is durable. Raises NotLeader if that
        leadership ended first (the operation may be lost: the client retries with the next
        leader)."""
        deadline = self._clock.now() + self.config.ha_commit_timeout_s + self.config.ha_lease_ttl_s
        with self._cond:
            while self._durable < number or self.term != term:
                if self.term != term or self.term == 0 or not self._cond.wait(deadline - self._clock.now()):
                    raise NotLeader(f"master {self.info.name} lost its leadership before the operation was logged")

    def close(self) -> None:
        """Stop campaigning; a leader hands over at once (revokes its lease)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._keeper.join(timeout=5)
        self.kv.close()

    # -- the campaign and the committer -------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._campaign():
                    self._lead()
                else:
                    self._stop.wait(_POLL_S)
            except (MetadataError, ProtocolError) as exc:
                logger.warning("master %s: HA: %s", self.info.name, exc)
                self._step_down(str(exc))
                self._stop.wait(_POLL_S)
        self._step_down("closing")

    def _campaign(self) -> bool:
        if self.kv.get(self._leader_key) is not None:
            return False
        lease = self.kv.grant(self.config.ha_lease_ttl_s)
        sent = self._clock.now()
        result = self.kv.txn([created_at(self._leader_key, 0)], [put_op(self._leader_key, self.info.encode(), lease)])
        if not result.succeeded:
            self.kv.revoke(lease)
            return False
        started = self._clock.now()
        with self._cond:  # NOTE: the lease is kept alive while the log loads; nothing is served yet
            self._lease, self.valid_until = lease, sent + self._valid_s()
        tables, upto = self._load()
        with self._cond:
            self._queue, self._appended, self._durable = [], upto, upto
        self._failing_since = None
        self._elected(tables)
        with self._cond:
            self.term = result.revision
        self.takeovers += 1
        logger.warning(
            "master %s is the leader (term %d): replayed %d records in %.3f s",
            self.info.name,
            self.term,
            tables.num_records,
            self._clock.now() - started,
        )
        return True

    def _lead(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._queue:
                    self._cond.wait(self.config.ha_lease_ttl_s / 4)
                batch, self._queue = self._queue, []
            if not self.leading():
                raise MetadataError("the leader lease lapsed (etcd unreachable or this process was paused)")
            if batch and not self._commit(batch):
                self._stop.wait(_POLL_S)  # NOTE: etcd did not answer: the batch is queued again
                continue
            if self._since_snapshot >= self.config.ha_snapshot_records:
                self._write_snapshot()

    def _commit(self, batch: list[tuple[int, list[journal.Record]]]) -> bool:
        """Log `batch` (the operations in order); False if etcd did not answer: the batch is
        back at the head of the queue, to be put again (the same keys, the same values) while
        the lease holds. Raises MetadataError: fenced (no longer the leader), or commits have
        failed for `ha_commit_timeout_s` (etcd refuses them: let another master try)."""
        entries: list[tuple[int, bytes]] = []
        first, records = batch[0][0], []
        for number, recs in batch:
            records.extend(recs)
            if len(records) >= 2000 or number == batch[-1][0]:
                entries.append((first, journal.encode(records)))
                first, records = number + 1, []
        for start in range(0, len(entries), 8):  # NOTE: keeps each request under etcd's size limit
            ops = [put_op(self._key("log", n), data) for n, data in entries[start : start + 8]]
            try:
                landed = self.kv.txn([created_at(self._leader_key, self.term)], ops).succeeded
            except MetadataError as exc:  # NOTE: a brief partition need not cost a failover
                now = self._clock.now()
                if self._failing_since is None:
                    self._failing_since = now
                if now - self._failing_since >= self.config.ha_commit_timeout_s:
                    raise
                logger.warning("master %s: logging operations failed, retrying: %s", self.info.name, exc)
                with self._cond:
                    self._queue[:0] = batch
                return False
            if not landed:
                raise MetadataError(f"fenced: the leader key is no longer ours (term {self.term})")
        self._since_snapshot += sum(len(recs) for _, recs in batch)
        self._failing_since = None
        with self._cond:
            self._durable = batch[-1][0]
            self._cond.notify_all()
        return True

    def _write_snapshot(self) -> None:
        upto, records = self._snapshot()
        with self._cond:  # operations up to `upto` are in the state: log them first
            batch = [item for item in self._queue if item[0] <= upto]
            self._queue = [item for item in self._queue if item[0] > upto]
        if batch and not self._commit(batch):
            return  # NOTE: etcd did not answer; the next round tries again
        chunks = [journal.encode(records[i : i + 5000]) for i in range(0, max(1, len(records)), 5000)]
        for i, chunk in enumerate(chunks):
            self._guarded([put_op(self._key("snap", upto) + b"/%06d" % i, chunk)])
        old = self.kv.get(self._prefix + b"snapshot")
        pointer = json.dumps({"upto": upto, "chunks": len(chunks)}).encode()
        log = self._prefix + b"log/"
        self._guarded([put_op(self._prefix + b"snapshot", pointer), delete_op(log, self._key("log", upto + 1))])
        if old is not None:
            stale = self._key("snap", int(json.loads(old[0])["upto"])) + b"/"
            self._guarded([delete_op(stale, prefix_end(stale))])
        self._since_snapshot = 0
        logger.info("master %s: snapshot of %d records after operation %d", self.info.name, len(records), upto)

    def _guarded(self, ops: list[Op]) -> None:
        """One transaction that applies only while our leader key is the one of our term."""
        if not self.kv.txn([created_at(self._leader_key, self.term)], ops).succeeded:
            raise MetadataError(f"fenced: the leader key is no longer ours (term {self.term})")

    def _load(self) -> tuple[journal.Tables, int]:
        """The tables as of the last logged operation, and its number."""
        tables, upto = journal.Tables(), 0
        pointer = self.kv.get(self._prefix + b"snapshot")
        if pointer is not None:
            meta = json.loads(pointer[0])
            upto = int(meta["upto"])
            chunks = self.kv.range(self._key("snap", upto) + b"/", prefix_end(self._key("snap", upto) + b"/"))
            if len(chunks) != int(meta["chunks"]):
                raise ProtocolError(f"snapshot {upto} has {len(chunks)} chunks, expected {meta['chunks']}")
            for _, data in chunks:
                tables.apply(journal.decode(data))
        log = self._prefix + b"log/"
        for key, data in self.kv.range(self._key("log", upto + 1), prefix_end(log)):
            records = journal.decode(data)
            tables.apply(records)
            upto = max(upto, int(key.rsplit(b"/", 1)[1], 16))
        self._since_snapshot = 0
        return tables, upto

    def _key(self, kind: str, number: int) -> bytes:
        return self._prefix + f"{kind}/{number:016x}".encode()

    # -- lease --------------------------------------------------------------------------

    def _valid_s(self) -> float:
        ttl = self.config.ha_lease_ttl_s
        return ttl - max(0.2, 0.15 * ttl)  # NOTE: the margin covers clock-rate drift and scheduling

    def _keepalive_loop(self) -> None:
        """Every TTL/4, a keepalive of its own (a thread, a new connection): one lost in a brief
        partition sits in TCP's retransmission backoff (0.2, 0.4, 0.8 s ...) and must not hold
        back the next, which gets through as soon as the link heals; a slow answer still counts."""
        while not self._stop.wait(self.config.ha_lease_ttl_s / 4):
            if self._lease:
                threading.Thread(
                    target=self._renew, args=(self._lease,), name="tsukimi-lease-renew", daemon=True
                ).start()

    def _renew(self, lease: int) -> None:
        kv = EtcdKV(self.config.ha_etcd, timeout_s=self.config.ha_lease_ttl_s)
        sent = self._clock.now()
        try:
            ttl = kv.keepalive(lease)
        except MetadataError as exc:
            logger.warning("master %s: lease keepalive failed: %s", self.info.name, exc)
            return
        finally:
            kv.close()
        with self._cond:
            if lease != self._lease:
                return
            if ttl > 0:  # NOTE: answers may come out of order: the latest send counts
                self.valid_until = max(self.valid_until, sent + self._valid_s())
            else:
                self.valid_until = 0.0
                self._cond.notify_all()

    def _step_down(self, why: str) -> None:
        with self._cond:
            was, lease = self.term, self._lease
            self.term, self._lease, self.valid_until = 0, 0, 0.0
            self._queue = []
            self._cond.notify_all()
        if was:
            logger.warning("master %s steps down (pid %d): %s", self.info.name, os.getpid(), why)
            self._deposed()
        if not lease:
            return
        with contextlib.suppress(MetadataError):  # NOTE: hands over at once; else the lease just expires
            self.kv.revoke(lease)
