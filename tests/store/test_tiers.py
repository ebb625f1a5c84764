"""The disk tier in the master state machine under a virtual clock: exact outcomes of
offload on eviction, promotion, invalidation, disk eviction, task timeouts and a holder's
re-registration after a restart (tsukimi/store/master/tiers.py, disk_ops.py)."""

from __future__ import annotations

import pytest

from tsukimi.clock import VirtualClock
from tsukimi.config import MasterConfig
from tsukimi.errors import OutOfSpace
from tsukimi.store import disk_protocol as dp
from tsukimi.store.ha import journal
from tsukimi.store.master import disk_ops
from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import MountSegment, ReplicaConfig

KIB = 1024
SEG = 16 * KIB


class Cluster:
    """A state with `n` holders c0.. (a segment of SEG and a disk d0.. each) whose disk work
    is simulated: `files[disk]` maps (key, put id) to the size written."""

    def __init__(self, n: int = 1, disk_bytes: int = 64 * KIB, **cfg: object) -> None:
        self.clock = VirtualClock()
        settings: dict[str, object] = {"lease_ttl_s": 1.0, "write_grace_s": 0.5, **cfg}
        self.state = MasterState(MasterConfig(**settings), self.clock)  # type: ignore[arg-type]
        self.files: dict[str, dict[tuple[str, int], int]] = {}
        for i in range(n):
            self.start(i, disk_bytes)

    def start(self, i: int, disk_bytes: int = 64 * KIB, client: str | None = None) -> list[bool]:
        """Holder i mounts its segment and disk and registers its files (a restart, if again)."""
        client = client or f"c{i}"
        self.state.registry.mount(MountSegment(client, f"seg{i}", f"te{i}", (i + 1) << 32, SEG), self.clock.now())
        disk_ops.mount(self.state.tiers, dp.MountDisk(client, f"d{i}", f"tcp://h:{i + 1}", disk_bytes), self.now)
        files = self.files.setdefault(f"d{i}", {})
        listed = [dp.DiskFile(k, v, size, 0) for (k, v), size in files.items()]
        accepted = disk_ops.register(self.state.tiers, dp.RegisterDiskFiles(client, f"d{i}", listed), self.now)
        for file, ok in zip(listed, accepted, strict=True):
            if not ok:
                del files[(file.key, file.put_id)]
        return accepted

    @property
    def now(self) -> float:
        return self.clock.now()

    def put(self, key: str, size: int = 4 * KIB, client: str = "c0", upsert: bool = False, **config: object) -> int:
        self.state.put_start(client, key, size, ReplicaConfig(**config), upsert)  # type: ignore[arg-type]
        put_id = self.state.pending[key].put_id
        self.state.put_end(client, key, put_id)
        return put_id

    def take(self, i: int = 0, client: str | None = None) -> list[dp.DiskTask]:
        """Holder i takes its tasks (without running them)."""
        op = dp.DiskSync(client or f"c{i}", f"d{i}")
        return disk_ops.sync(self.state.tiers, op, self.now).tasks

    def report(self, results: list[dp.TaskResult], i: int = 0) -> None:
        disk_ops.sync(self.state.tiers, dp.DiskSync(f"c{i}", f"d{i}", results, max_tasks=0), self.now)

    def work(self, i: int = 0) -> list[dp.DiskTask]:
        """Holder i takes its tasks, runs them and reports them; the tasks."""
        tasks = self.take(i)
        self.report([self.run(task, i) for task in tasks], i)
        return tasks

    def run(self, task: dp.DiskTask, i: int = 0, checksum: int | None = None) -> dp.TaskResult:
        files = self.files[f"d{i}"]
        if isinstance(task, dp.DeleteTask):
            files.pop((task.key, task.put_id), None)
        elif isinstance(task, dp.OffloadTask):
            files[(task.key, task.put_id)] = task.size
        elif (task.key, task.put_id) not in files:
            return dp.TaskResult(task.task_id, False, "no such file")
        return dp.TaskResult(task.task_id, True, checksum=checksum)

    def advance(self, seconds: float, dead: set[str] | None = None) -> None:
        self.clock.advance(seconds)
        for client_id in set(self.state.registry.clients) - (dead or set()):
            self.state.registry.heartbeat(client_id, self.now)
        self.state.tick()

    def where(self, key: str) -> tuple[int, list[str]]:
        """(memory replicas, disks with a copy) of `key`."""
        record = self.state.objects[key]
        return len(record.replicas), list(record.disks)


def kinds(tasks: list[dp.DiskTask]) -> list[tuple[str, str]]:
    return [(type(t).__name__, t.key) for t in tasks]


def test_below_the_offload_watermark_nothing_goes_to_disk() -> None:
    c = Cluster()
    for i in range(2):
        c.put(f"k{i}")
    c.advance(0.2)
    assert c.work() == [] and c.where("k0") == (1, [])
    c.state.check_invariants()


def test_eviction_offloads_and_the_object_stays_readable_until_its_copy_is_made() -> None:
    c = Cluster(offload_watermark=1.0)  # no copies ahead of eviction
    for i in range(4):
        c.put(f"k{i}")  # the segment is full
    with pytest.raises(OutOfSpace):
        c.put("k4")  # the coldest objects are being offloaded: their memory is not free yet
    assert c.state.get_replicas("k0")[0]  # still readable from memory
    c.advance(1.1)  # the read lease ends
    assert kinds(c.work()) == [("OffloadTask", "k0"), ("OffloadTask", "k1")]
    assert c.where("k0") == (0, ["d0"]) and c.where("k1") == (0, ["d0"])  # memory freed once copied
    c.put("k4")
    replicas, size = c.state.get_replicas("k0")
    copies = c.state.tiers.locations(c.state.objects["k0"], c.now)
    assert replicas == [] and size == 4 * KIB and [(d.disk_id, d.endpoint) for d in copies] == [("d0", "tcp://h:1")]
    assert copies[0].put_id == c.state.objects["k0"].put_id
    c.state.check_invariants()


def test_copies_are_made_ahead_of_eviction_and_eviction_then_frees_them_at_once() -> None:
    c = Cluster(offload_watermark=0.5)
    for i in range(3):
        c.put(f"k{i}")
    c.advance(0.2)  # 12 KiB used, 8 KiB allowed without a copy: the coldest is copied
    assert kinds(c.work()) == [("OffloadTask", "k0")]
    assert c.where("k0") == (1, ["d0"])  # copied, still in memory
    c.put("k3")
    c.put("k4")  # eviction frees k0's memory at once: it is on disk
    assert c.where("k0") == (0, ["d0"]) and c.where("k1") == (1, [])
    assert c.state.counters["evictions"] == 0
    c.state.check_invariants()


def test_a_removed_or_replaced_copy_is_deleted_only_after_its_read_lease() -> None:
    c = Cluster(offload_watermark=0.1)
    old = c.put("k")
    c.advance(0.2)
    c.work()
    assert c.state.get_replicas("k")[0]  # a read lease
    c.put("k", upsert=True)  # a new version: the old copy is invalid at once...
    assert c.state.tiers.locations(c.state.objects["k"], c.now) == []
    assert c.take() == []  # ...but not deleted while a reader may read it
    c.advance(1.1)
    deletes = [t for t in c.work() if isinstance(t, dp.DeleteTask)]
    assert [(t.key, t.put_id) for t in deletes] == [("k", old)] and ("k", old) not in c.files["d0"]
    c.state.check_invariants()


def test_a_hit_promotes_a_disk_only_object_into_its_holders_memory() -> None:
    c = Cluster(offload_watermark=1.0)
    for i in range(4):
        c.put(f"k{i}")
    with pytest.raises(OutOfSpace):
        c.put("k4")
    c.advance(1.1)
    c.work()
    c.state.remove("k2", force=True)
    c.state.remove("k3", force=True)
    c.advance(1.1)
    c.work()  # the deletes
    assert c.state.get_replicas("k0")[0] == []  # served from disk; queues a promotion
    (task,) = c.take()
    assert isinstance(task, dp.PromoteTask) and task.te_segment == "te0" and task.key == "k0"
    assert c.state.get_replicas("k0")[0] == []  # still from disk until the holder reports
    c.report([c.run(task)])
    assert c.where("k0") == (1, ["d0"])
    assert [r.address for r in c.state.get_replicas("k0")[0]] == [task.address]
    assert c.state.counters["promoted_bytes"] == 4 * KIB
    c.state.check_invariants()


def test_a_promotion_frees_only_memory_that_is_on_disk_too() -> None:
    c = Cluster(offload_watermark=1.0, high_watermark=1.0)
    for i in range(4):
        c.put(f"k{i}")
    with pytest.raises(OutOfSpace):
        c.put("k4")
    c.advance(1.1)
    c.work()  # k0 on disk only
    c.put("k4")  # full again: k1..k4 in memory, none on disk
    assert c.state.get_replicas("k0")[0] == []
    assert c.take() == [] and c.state.counters["promotions_skipped"] == 1  # no room: nothing dropped
    assert set(c.state.objects) == {f"k{i}" for i in range(5)}
    c.state.check_invariants()


def test_a_full_disk_evicts_its_least_recently_used_copies() -> None:
    c = Cluster(disk_bytes=8 * KIB, offload_watermark=1.0, disk_high_watermark=1.0)
    for i in range(4):
        c.put(f"k{i}")
    with pytest.raises(OutOfSpace):
        c.put("k4")
    c.advance(1.1)
    c.work()  # k0 on disk
    c.put("k4")
    with pytest.raises(OutOfSpace):
        c.put("k5")
    c.work()  # k1 on disk: the disk is full
    c.put("k5")
    with pytest.raises(OutOfSpace):
        c.put("k6")  # k2 must go to disk: k0, the least recently used copy, is deleted for it
    assert "k0" not in c.state.objects and c.where("k1") == (0, ["d0"])
    assert c.state.counters["disk_evictions"] == 1
    c.advance(1.1)
    assert kinds(c.work()) == [("DeleteTask", "k0"), ("OffloadTask", "k2")]
    c.state.check_invariants()


def test_a_copy_being_read_is_not_evicted_from_its_disk() -> None:
    c = Cluster(disk_bytes=8 * KIB, offload_watermark=0.1, disk_high_watermark=0.9, promotion_on_hit=False)
    for i in range(2):
        c.put(f"k{i}")
    c.advance(0.2)
    c.work()  # both copied: 8 KiB of 8, over the watermark
    for key in ("k0", "k1"):
        c.state.tiers.release_memory(c.state.objects[key])
        assert c.state.get_replicas(key)[0] == []  # read from disk: leased
    c.advance(0.5)
    assert set(c.state.objects) == {"k0", "k1"}  # not evicted while leased
    c.advance(0.6)  # the leases ended
    assert set(c.state.objects) == {"k1"}
    c.state.check_invariants()


def test_an_offload_of_a_stale_version_or_with_a_wrong_checksum_is_discarded() -> None:
    c = Cluster(offload_watermark=0.1)
    c.put("k")
    c.put("j")
    c.advance(0.2)
    tasks = c.take()
    c.put("k", upsert=True)  # k's offload is now of a stale version
    c.state.objects["j"].checksum = 7  # j's memory replica does not match what its writer wrote
    c.report([c.run(t, checksum=8) for t in tasks])
    assert c.where("k") == (1, []) and c.where("j") == (1, [])
    assert c.state.counters["offloads_discarded"] == 2
    assert kinds(c.take()) == [("DeleteTask", "j"), ("DeleteTask", "k")]  # never copies: deleted at once
    c.state.check_invariants()


def test_a_task_the_holder_never_reports_times_out() -> None:
    c = Cluster(offload_watermark=0.1, disk_task_timeout_s=2.0)
    c.put("k")
    c.advance(0.2)
    (offload,) = c.take()
    c.advance(2.1)
    assert c.state.counters["disk_tasks_expired"] == 1 and c.where("k") == (1, [])
    assert isinstance(c.take()[0], dp.DeleteTask)  # the file may have landed late
    c.report([c.run(offload)])  # too late: ignored
    assert c.where("k") == (1, []) and c.state.tiers.registry.disks["d0"].used <= 4 * KIB
    c.state.check_invariants()


def test_a_restarted_holder_gets_back_its_current_copies_and_no_stale_one() -> None:
    c = Cluster(offload_watermark=0.1)
    c.state.registry.mount(MountSegment("c1", "seg1", "te1", 9 << 32, SEG), c.now)  # a holder without disk
    keys = ("kept", "replaced", "removed", "evicted")
    versions = {key: c.put(key, preferred_segments=("te0",)) for key in keys}
    c.advance(0.2)
    assert kinds(c.work()) == [("OffloadTask", key) for key in keys]
    for key in keys:
        c.state.tiers.release_memory(c.state.objects[key])  # only on d0 now
    c.advance(3.5, dead={"c0"})  # holder 0 is dropped: its copies are lost copies
    assert not c.state.objects and c.state.counters["objects_lost"] == 4
    c.put("evicted", client="c1")  # new versions while it is away: one is evicted,
    newer = c.put("replaced", client="c1")  # one stays,
    c.put("removed", client="c1")
    c.state.remove("removed", force=True)  # one is removed
    for i in range(3):
        c.put(f"fill{i}", client="c1")
    assert "evicted" not in c.state.objects
    assert c.start(0, client="c0-restarted") == [True, False, False, False]  # in the order of `keys`
    assert c.state.objects["kept"].put_id == versions["kept"] and c.where("kept") == (0, ["d0"])
    assert c.state.objects["replaced"].put_id == newer and "evicted" not in c.state.objects
    assert set(c.files["d0"]) == {("kept", versions["kept"])}
    c.state.check_invariants()


def test_a_registration_retried_after_a_lost_reply_keeps_the_copy() -> None:
    c = Cluster(offload_watermark=0.1)
    put_id = c.put("k")
    c.advance(0.2)
    c.work()
    again = dp.RegisterDiskFiles("c0", "d0", [dp.DiskFile("k", put_id, 4 * KIB, 0)])
    assert disk_ops.register(c.state.tiers, again, c.now) == [True] and c.where("k") == (1, ["d0"])
    c.state.check_invariants()


def test_a_disk_never_seen_is_adopted_by_a_restarted_master_not_by_an_ha_restored_one() -> None:
    c = Cluster(offload_watermark=0.1)
    put_id = c.put("k", group="page", session="writer")
    c.advance(0.2)
    c.work()
    c.state.tiers.release_memory(c.state.objects["k"])
    restarted = Cluster(n=0)  # a lone master that restarted: the disk is all that is left
    restarted.files = {"d0": dict(c.files["d0"])}
    assert restarted.start(0) == [True] and restarted.state.objects["k"].put_id == put_id
    ha = Cluster(n=0)  # an HA leader that replayed the log: the copy is a lost copy until d0 registers
    ha.state = journal.restore(_tables(c.state), c.state.config, ha.clock, epoch=7)
    ha.files = {"d0": dict(c.files["d0"])}
    assert {d: {k: c[0] for k, c in copies.items()} for d, copies in ha.state.tiers.registry.lost.items()} == {
        "d0": {"k": put_id}
    }
    assert "k" not in ha.state.objects
    assert ha.start(0) == [True] and ha.where("k") == (0, ["d0"])
    adopted = ha.state.objects["k"].config  # a lost copy comes back in its group, with its writer
    assert (adopted.group, adopted.session) == ("page", "writer") and ha.state.objects.groups == {"page": {"k"}}
    c.state.remove("k", force=True)  # removed before the failover: its file must not come back
    ha = Cluster(n=0)
    ha.state = journal.restore(_tables(c.state), c.state.config, ha.clock, epoch=8)
    ha.files = {"d0": {("k", put_id): 4 * KIB}}
    assert ha.start(0) == [False] and not ha.state.objects and ha.files["d0"] == {}


def _tables(state: MasterState) -> journal.Tables:
    tables = journal.Tables()
    tables.apply(journal.snapshot_of(state))
    return tables


def test_a_disk_over_its_watermark_sheds_its_coldest_copies() -> None:
    c = Cluster(disk_bytes=8 * KIB, offload_watermark=0.1, disk_high_watermark=0.9, evict_ratio=0.3)
    for i in range(2):
        c.put(f"k{i}")
    c.advance(0.2)
    c.work()  # both on disk: 8 KiB of 8
    c.state.tiers.release_memory(c.state.objects["k0"])
    c.advance(0.2)  # above 90 %: down to 60 %, the coldest copy first; k0 had no other replica
    assert "k0" not in c.state.objects and c.where("k1") == (1, ["d0"])
    c.state.check_invariants()


def test_on_put_copies_every_object_when_its_put_ends() -> None:
    c = Cluster(offload="on_put")
    c.put("k")
    assert kinds(c.take()) == [("OffloadTask", "k")]
