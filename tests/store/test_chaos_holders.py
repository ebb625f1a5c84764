"""Chaos with real processes: holders and clients SIGKILLed or SIGSTOPped mid-flight.

Each test runs `tsukimi master`, three `tsukimi holder`s and workload clients as processes
(tests/store/procs.py), injects one fault, and asserts exact outcomes and bounded timings;
each prints one `chaos <scenario>: ...` line with what it measured (docs/reliability.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.store.procs import Master, Proc, ProcessGroup, Record, key_states, process_group, read_records, wait_for
from tests.store.workload import value_of
from tsukimi.config import Config, load
from tsukimi.errors import ChecksumMismatch, TransferError, TsukimiError
from tsukimi.netio import free_port
from tsukimi.store.client import StoreClient
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
SEGMENT_BYTES = 64 * MIB
CLIENT_TTL_S = 1.0
HEARTBEAT_S = 0.2
LEASE_TTL_S = 1.0
WRITE_GRACE_S = 0.5
TICK_S = 0.05
SLACK_S = 0.5  # scheduling on a loaded 2-CPU runner, and the poll interval
MASTER_SETTINGS = (
    f"master.client_ttl_s={CLIENT_TTL_S}",
    f"master.heartbeat_interval_s={HEARTBEAT_S}",
    f"master.lease_ttl_s={LEASE_TTL_S}",
    f"master.write_grace_s={WRITE_GRACE_S}",
    f"master.tick_interval_s={TICK_S}",
    "master.put_timeout_s=30",  # NOTE: abandoned puts must be reclaimed because their writer died
)
CLIENT_SETTINGS = (f"client.heartbeat_interval_s={HEARTBEAT_S}", "client.rpc_timeout_s=2.0")
TCP_SETTINGS = ("transfer.transport=tcp", "transfer.timeout_s=0.5")  # a partition needs a network; <= write_grace_s
OP_BOUND_S = LEASE_TTL_S + SLACK_S  # no get may take longer: reads end within the lease


@dataclass
class Cluster:
    group: ProcessGroup
    master: Master
    holder_names: list[str]
    settings: tuple[str, ...]  # every process's --set overrides
    tmp_path: Path

    def client(self, *extra: str) -> StoreClient:
        """A store client in the test process, configured like the processes."""
        config = load(Config, None, [*self.settings, *extra])
        return StoreClient(replace(config, client=replace(config.client, master=self.master.rpc_url)))

    def segments_of(self, te_segment: str) -> list[Record]:
        return [s for s in self.master.segments() if s["te_segment"] == te_segment]

    def used(self) -> int:
        return sum(int(s["used"]) for s in self.master.segments())

    def replica_holders(self, key: str) -> list[str]:
        info = self.master.query_key(key)
        return [] if info is None else [str(r["te_segment"]) for r in info["replicas"]]


def start_cluster(
    group: ProcessGroup,
    tmp_path: Path,
    settings: tuple[str, ...] = (),
    master_settings: tuple[str, ...] = (),
    holder_settings: dict[int, tuple[str, ...]] | None = None,
) -> Cluster:
    """A master and three holders of SEGMENT_BYTES; `holder_settings[i]`: holder i's extras."""
    common = CLIENT_SETTINGS + settings
    master = group.spawn_master([*MASTER_SETTINGS, *master_settings, *settings])
    procs = [
        group.start_holder(master.rpc_url, SEGMENT_BYTES, [*common, *(holder_settings or {}).get(i, ())], f"holder{i}")
        for i in range(3)
    ]
    names = [group.ready_holder(proc).name for proc in procs]
    wait_for(lambda: len(master.segments()) == 3, 10, "three holders mounted")
    return Cluster(group, master, names, common, tmp_path)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[ProcessGroup]:
    with process_group(tmp_path) as procs:
        yield procs
        assert procs.procs, "the test started no process"
    assert not procs.leaked_shm, f"processes that exited normally left shm files: {procs.leaked_shm}"


def holder_proc(cluster: Cluster, index: int) -> Proc:
    return [p for p in cluster.group.procs if p.name == f"holder{index}"][-1]


def wait_gone(cluster: Cluster, te_segment: str, since: float, bound_s: float) -> float:
    """Seconds from `since` until no segment of `te_segment` is listed (asserts the bound)."""
    wait_for(lambda: not cluster.segments_of(te_segment), bound_s + 2, f"{te_segment} dropped")
    detection_s = time.monotonic() - since
    assert detection_s <= bound_s, f"{te_segment} dropped after {detection_s:.3f} s > {bound_s} s"
    return detection_s


# -- a. a holder SIGKILLed under a replicated workload ---------------------------------------


def test_holder_sigkilled_during_replicated_workload(group: ProcessGroup, tmp_path: Path) -> None:
    cluster = start_cluster(group, tmp_path)
    out = tmp_path / "workload.jsonl"
    workload = group.spawn_workload(
        cluster.master.rpc_url, out, 30, seed=1, keys=48, value_bytes=64 << 10, replicas=2, settings=cluster.settings
    )
    wait_for(lambda: len(read_records(out)) >= 200, 20, "the workload ran 200 operations")
    victim = cluster.holder_names[0]
    killed_at = time.monotonic()
    holder_proc(cluster, 0).kill()
    detection_s = wait_gone(cluster, victim, killed_at, CLIENT_TTL_S + TICK_S + SLACK_S)
    lower = CLIENT_TTL_S - HEARTBEAT_S - TICK_S
    assert detection_s >= lower, f"dropped after {detection_s:.3f} s: before client_ttl could pass"
    after_drop = len(read_records(out))
    wait_for(lambda: len(read_records(out)) >= after_drop + 200, 20, "200 more operations after the drop")
    workload.terminate(timeout_s=10)
    records = read_records(out)
    assert records[-1]["op"] == "summary" and records[-1]["stopped"], records[-1]
    ops = [r for r in records if r["op"] != "summary"]
    mismatches = [r for r in ops if r.get("mismatch")]
    lost = [r for r in ops if r.get("lost")]
    failed = [r for r in ops if "error" in r]
    hangs = [r for r in ops if float(r["elapsed_s"]) > OP_BOUND_S]
    assert mismatches == [] and lost == [] and hangs == [], (mismatches, lost, hangs)
    # in flight to the dead holder: a read failed over; a write failed cleanly (and is retriable)
    assert all(r["error"] == "TransferError" and r["retriable"] for r in failed if r["op"] != "remove"), failed
    states = key_states(out)
    with cluster.client() as reader:
        keys = sorted(states)
        got = [r.value() for r in reader.batch_get(keys)]
    for key, data in zip(keys, got, strict=True):
        version = (
            None
            if data is None
            else next(
                (
                    v
                    for v in {states[key].version, *states[key].maybe}
                    if v is not None and data == value_of(key, v, 64 << 10)
                ),
                -1,
            )
        )
        assert version != -1, f"{key}: bytes of no version it may hold"
        assert states[key].allows(version), f"{key}: holds version {version}, acknowledged {states[key]}"
    keys_lost = sum(1 for key, data in zip(keys, got, strict=True) if data is None and states[key].version is not None)
    assert keys_lost == 0
    assert victim not in {s["te_segment"] for s in cluster.master.segments()}
    worst_get = max(float(r["elapsed_s"]) for r in ops if r["op"] == "get")
    print(
        f"\nchaos holder_sigkill: detection_s={detection_s:.3f} keys_lost={keys_lost} hangs={len(hangs)} "
        f"mismatches={len(mismatches)} ops={len(ops)} failed_ops={len(failed)} worst_get_s={worst_get:.3f} "
        f"keys_checked={len(keys)}"
    )


# -- b. a holder SIGKILLed and restarted under the same name ------------------------------------


def _put_pinned_keys(client: StoreClient, victim: str) -> tuple[list[str], list[str]]:
    """Keys with their only replica on `victim`, and keys with one there and one elsewhere."""
    only = [f"only{i}" for i in range(8)]
    both = [f"both{i}" for i in range(8)]
    for key in only:
        client.put(key, value_of(key, 1, 100_000), replicas=1, preferred=[victim])
    for key in both:
        client.put(key, value_of(key, 1, 100_000), replicas=2, preferred=[victim])
    return only, both


def test_holder_restarted_under_the_same_name(group: ProcessGroup, tmp_path: Path) -> None:
    port = free_port()
    slow_ttl = ("master.client_ttl_s=30",)  # NOTE: only the new incarnation may drop the old one
    cluster = start_cluster(group, tmp_path, master_settings=slow_ttl, holder_settings={0: (f"transfer.port={port}",)})
    victim = cluster.holder_names[0]
    assert victim.endswith(f":{port}")
    with cluster.client() as client:
        only, both = _put_pinned_keys(client, victim)
        assert all(cluster.replica_holders(k) == [victim] for k in only)
        assert all(cluster.replica_holders(k)[0] == victim for k in both)
        old_client = {s["client_id"] for s in cluster.segments_of(victim)}
        killed_at = time.monotonic()
        holder_proc(cluster, 0).kill()
        restarted = group.spawn_holder(
            cluster.master.rpc_url, SEGMENT_BYTES, [*cluster.settings, f"transfer.port={port}"], "holder0"
        )
        restart_s = time.monotonic() - killed_at
        assert restarted.name == victim
        # at once: by the time the new incarnation printed its ready line, the old one is gone
        listed = cluster.segments_of(victim)
        assert [s["client_id"] for s in listed if s["client_id"] in old_client] == [], listed
        assert len(listed) == 1 and listed[0]["used"] == 0, listed
        assert restart_s < 30  # dropped by the mount, not by client_ttl
        assert [client.get(k) for k in only] == [None] * len(only)
        assert client.batch_exists(only) == [False] * len(only)
        assert [cluster.master.query_key(k) for k in only] == [None] * len(only)
        assert [client.get(k) for k in both] == [value_of(k, 1, 100_000) for k in both]
        assert all(victim not in cluster.replica_holders(k) for k in both)
        client.put("fresh", value_of("fresh", 1, 100_000), replicas=1, preferred=[victim])
        assert cluster.replica_holders("fresh") == [victim]
        assert client.get("fresh") == value_of("fresh", 1, 100_000)
        assert cluster.segments_of(victim)[0]["used"] > 0
    print(
        f"\nchaos holder_restart_same_name: detection_s=0 (at the new mount; restart took {restart_s:.3f} s) "
        f"keys_lost={len(only)} (only replica on it, now misses) keys_served_elsewhere={len(both)} "
        f"wrong_bytes=0 hangs=0"
    )


# -- c. a client SIGKILLed between put_start and put_end -----------------------------------------


def test_client_sigkilled_between_put_start_and_put_end(group: ProcessGroup, tmp_path: Path) -> None:
    cluster = start_cluster(group, tmp_path)
    before = cluster.used()
    hung, replicas = group.spawn_put_hang(cluster.master.rpc_url, "hung", MIB, replicas=2, settings=cluster.settings)
    assert len(replicas) == 2
    held = cluster.used()
    assert held >= before + 2 * MIB
    with cluster.client() as client:
        time.sleep(CLIENT_TTL_S + 2 * HEARTBEAT_S)  # alive (heartbeating): its put stays pending
        assert cluster.used() == held
        info = cluster.master.query_key("hung")
        assert info is not None and info["complete"] is False
        assert client.get("hung") is None and client.exists("hung") is False
        killed_at = time.monotonic()
        hung.kill()
        bound_s = CLIENT_TTL_S + WRITE_GRACE_S + TICK_S + SLACK_S
        wait_for(lambda: cluster.master.query_key("hung") is None, bound_s, "the abandoned put dropped")
        dropped_s = time.monotonic() - killed_at
        assert client.exists("hung") is False and client.get("hung") is None
        wait_for(lambda: cluster.used() == before, bound_s, "the abandoned put's blocks freed")
        reclaim_s = time.monotonic() - killed_at
        assert dropped_s >= CLIENT_TTL_S - HEARTBEAT_S - TICK_S
        # quarantined for write_grace_s after the drop (a poll may see the drop late: bound from the kill)
        assert reclaim_s >= CLIENT_TTL_S - HEARTBEAT_S - TICK_S + WRITE_GRACE_S
        assert reclaim_s <= bound_s
        client.put("hung", value_of("hung", 2, MIB), replicas=2)
        assert client.get("hung") == value_of("hung", 2, MIB)
    print(
        f"\nchaos client_sigkill_mid_put: detection_s={dropped_s:.3f} reclaim_s={reclaim_s:.3f} "
        f"(bound {bound_s:.2f}) keys_lost=0 visible_partial=0 hangs=0"
    )


# -- d. a holder SIGSTOPped (a partition) past client_ttl, then SIGCONTed -------------------------


NUM_READERS = 4


class _Reader:
    """Gets `keys` in a loop on a thread until `finish()`, keeping the worst latency and
    every wrong value or error."""

    def __init__(self, client: StoreClient, keys: list[str]) -> None:
        self.client, self.keys = client, keys
        self.count, self.worst_s = 0, 0.0
        self.wrong: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos-reader", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            key = self.keys[self.count % len(self.keys)]
            started = time.monotonic()
            try:
                data = self.client.get(key)
            except TsukimiError as exc:
                self.errors.append(f"{key}: {exc!r}")
            else:
                if data != value_of(key, 1, 100_000):
                    self.wrong.append(key)
            self.worst_s = max(self.worst_s, time.monotonic() - started)
            self.count += 1

    def finish(self) -> None:
        self._stop.set()
        self.thread.join(timeout=OP_BOUND_S + 5)
        assert not self.thread.is_alive(), "a get hung"


def test_holder_sigstopped_past_client_ttl_then_resumed(group: ProcessGroup, tmp_path: Path) -> None:
    cluster = start_cluster(group, tmp_path, settings=TCP_SETTINGS)
    victim = cluster.holder_names[0]
    with cluster.client() as client:
        only, both = _put_pinned_keys(client, victim)
        stopped_proc = holder_proc(cluster, 0)
        readers = [_Reader(client, both[i::NUM_READERS]) for i in range(NUM_READERS)]
        stopped_at = time.monotonic()
        stopped_proc.stop()
        for reader in readers:
            reader.thread.start()
        detection_s = wait_gone(cluster, victim, stopped_at, CLIENT_TTL_S + TICK_S + SLACK_S)
        assert detection_s >= CLIENT_TTL_S - HEARTBEAT_S - TICK_S
        for reader in readers:
            reader.finish()
            assert reader.count > 0 and reader.wrong == [] and reader.errors == [], (reader.wrong, reader.errors)
        worst_get_s = max(reader.worst_s for reader in readers)
        assert worst_get_s <= OP_BOUND_S, worst_get_s
        assert [client.get(k) for k in only] == [None] * len(only)
        assert [client.get(k) for k in both] == [value_of(k, 1, 100_000) for k in both]
        time.sleep(max(0.0, CLIENT_TTL_S + 0.5 - (time.monotonic() - stopped_at)))
        stopped_proc.cont()
        resumed_at = time.monotonic()
        wait_for(lambda: bool(cluster.segments_of(victim)), 5, "the resumed holder remounted")
        remount_s = time.monotonic() - resumed_at
        assert [s["used"] for s in cluster.segments_of(victim)] == [0]  # it came back empty
        assert [client.get(k) for k in only] == [None] * len(only)
        assert client.batch_exists(only) == [False] * len(only)
        assert [client.get(k) for k in both] == [value_of(k, 1, 100_000) for k in both]
        assert all(victim not in cluster.replica_holders(k) for k in both)
        wait_for(lambda: all(s["healthy"] for s in cluster.segments_of(victim)), 2, "resumed holder healthy")
        client.put("fresh", value_of("fresh", 1, 100_000), replicas=1, preferred=[victim])
        assert cluster.replica_holders("fresh") == [victim]
        assert client.get("fresh") == value_of("fresh", 1, 100_000)
    print(
        f"\nchaos holder_sigstop_partition: detection_s={detection_s:.3f} remount_s={remount_s:.3f} "
        f"keys_lost={len(only)} (only replica on it) reads_while_stopped={sum(r.count for r in readers)} "
        f"worst_get_s={worst_get_s:.3f} wrong_bytes=0 hangs=0"
    )


# -- e. a replica corrupted in a holder's memory, with client.checksum ----------------------------


def test_corrupted_replica_detected_by_checksum(group: ProcessGroup, tmp_path: Path) -> None:
    cluster = start_cluster(group, tmp_path, settings=("client.checksum=true",))
    victim = cluster.holder_names[0]
    with cluster.client() as client, TransferEngine(config=Config()) as vandal:
        client.put("two", value_of("two", 1, 100_000), replicas=2, preferred=[victim])
        client.put("one", value_of("one", 1, 100_000), replicas=1, preferred=[victim])
        for key in ("two", "one"):
            info = cluster.master.query_key(key)
            assert info is not None
            first = info["replicas"][0]
            assert first["te_segment"] == victim
            garbage = bytearray(b"\xa5" * 4096)
            status = vandal.transfer([TransferRequest(OpCode.WRITE, victim, first["address"] + 5000, garbage)])
            assert status[0].state is RequestState.COMPLETED, status
        assert client.get("two") == value_of("two", 1, 100_000)  # the other replica's bytes
        with pytest.raises(ChecksumMismatch):
            client.get("one")
        with cluster.client("client.checksum=false") as unchecked:  # what the checksum saved us from
            assert unchecked.get("one") != value_of("one", 1, 100_000)
    print("\nchaos replica_corrupted: detected=2/2 served_other_replica=1 checksum_mismatch=1 wrong_bytes=0 hangs=0")


def test_transfer_error_is_what_a_dead_only_replica_gives(group: ProcessGroup, tmp_path: Path) -> None:
    """Between a holder's death and its drop, a get of a key whose only replica it held fails
    fast with TransferError (never wrong bytes), then misses once the master dropped it."""
    cluster = start_cluster(group, tmp_path)
    victim = cluster.holder_names[0]
    with cluster.client() as client:
        client.put("lone", value_of("lone", 1, 100_000), replicas=1, preferred=[victim])
        killed_at = time.monotonic()
        holder_proc(cluster, 0).kill()
        started = time.monotonic()
        with pytest.raises(TransferError):
            client.get("lone")
        fail_s = time.monotonic() - started
        assert fail_s <= OP_BOUND_S
        wait_gone(cluster, victim, killed_at, CLIENT_TTL_S + TICK_S + SLACK_S)
        assert client.get("lone") is None and client.exists("lone") is False
    print(f"\nchaos holder_sigkill_only_replica: get_fail_s={fail_s:.3f} keys_lost=1 wrong_bytes=0 hangs=0")
