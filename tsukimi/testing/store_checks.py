"""The store semantics suite: what every deployment shape of the store must do, as checks
that run against any factory of deployments (`deployments`).

Each check takes a DeploymentMaker and uses one deployment from it; a check that puts objects
through its own client removes them all (force) when it ends, so checks can share one
deployment in order. STORE_CHECKS lists them; `check_store(make_deployment)` runs them all:

    from tsukimi.testing.deployments import fresh_client, lend, start_deployment
    from tsukimi.testing.store_checks import check_store
    with start_deployment("multiprocess") as dep:
        check_store(lend(dep))

The deployment's master must have the timeouts of deployments.MASTER (leases of 1 s, puts
reclaimed after 1 s) and two holders of HOLDER_BYTES each (or more: the store spread over a
lab's hosts has three, tsukimi/testing/lab_store.py).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from tsukimi.clock import WallClock
from tsukimi.config import ClientConfig, Config
from tsukimi.errors import InvalidArgument, InvalidBufferError, LeaseHeld, ObjectExists, ObjectNotFound
from tsukimi.rpc import RpcClient
from tsukimi.store import protocol as p
from tsukimi.store.client import StoreClient
from tsukimi.store.protocol import CODEC
from tsukimi.testing.assertions import raises, run_checks
from tsukimi.testing.deployments import HOLDER_BYTES, Deployment, DeploymentMaker, fresh_client
from tsukimi.testing.processes import wait_until
from tsukimi.testing.store_admin_checks import ADMIN_CHECKS
from tsukimi.testing.store_parts_checks import PARTS_CHECKS
from tsukimi.transfer import TransferEngine

MIB = 1 << 20


def byte_exact_round_trips_and_misses(make_deployment: DeploymentMaker) -> None:
    """put/get/get_into round-trip 1 B to 3 MiB byte-exact with 2 replicas; misses are None
    and 0; registered memory goes zero-copy both ways; a too small buffer and an empty key
    are refused."""
    rng = np.random.default_rng(1)
    with make_deployment() as dep, fresh_client(dep) as client:
        for i, size in enumerate([1, 4096, 65536 + 7, 3 * MIB]):
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            client.put(f"rt{i}", data, replicas=2)
            assert client.get(f"rt{i}") == bytearray(data), f"get of {size} B"
            buf = bytearray(size + 10)
            assert client.get_into(f"rt{i}", buf) == size and bytes(buf[:size]) == data, f"get_into of {size} B"
        assert client.get("missing") is None and client.get_into("missing", bytearray(4)) is None
        registered = client.engine.allocate(4096)  # zero-copy on registered memory, passed as is
        registered.view[:] = bytes(range(256)) * 16
        client.put("registered", registered)
        registered.view[:] = bytes(4096)
        assert client.get_into("registered", registered) == 4096 and bytes(registered.view) == bytes(range(256)) * 16
        assert client.batch_exists(["rt0", "missing"]) == [True, False]
        many = ["missing"] * p.MAX_BATCH + ["rt1", "rt2"]  # more than one master call holds
        assert client.batch_exists(many) == [False] * p.MAX_BATCH + [True, True]
        with raises(InvalidArgument):
            client.batch_exists(["rt0", ""])
        with raises(InvalidBufferError):
            client.get_into("rt3", bytearray(10))
        with raises(InvalidArgument):
            client.put("", b"x")


def reput_fails_upsert_replaces(make_deployment: DeploymentMaker) -> None:
    """A second put of a key raises ObjectExists (in a batch: that key's result); upsert replaces."""
    with make_deployment() as dep, fresh_client(dep) as client:
        client.put("k", b"one")
        with raises(ObjectExists):
            client.put("k", b"two")
        client.put("k", b"three!", upsert=True)
        assert client.get("k") == bytearray(b"three!")
        results = client.batch_put([("new", b"n"), ("k", b"dup")])
        assert results[0] is None and isinstance(results[1], ObjectExists), results


def remove_under_lease(make_deployment: DeploymentMaker) -> None:
    """A get leases the object for 1 s: remove raises LeaseHeld until then, force removes at
    once; removing what is gone returns False."""
    with make_deployment() as dep, fresh_client(dep) as client:
        client.put("leased", b"x")
        client.get("leased")  # lease for 1 s
        with raises(LeaseHeld):
            client.remove("leased")
        WallClock().sleep(1.1)
        assert client.remove("leased") is True
        client.put("forced", b"x")
        client.get("forced")
        assert client.remove("forced", force=True) is True
        assert client.remove("forced") is False


def replicas_on_distinct_segments(make_deployment: DeploymentMaker) -> None:
    """2 replicas land on 2 distinct holders' segments (the master's /query_key says so, and
    404 for an unknown key)."""
    with make_deployment() as dep, fresh_client(dep) as client:
        client.put("two", b"x" * 1000, replicas=2)
        info = httpx.get(dep.http_url + "/query_key", params={"key": "two"}, timeout=5).json()
        assert len({r["te_segment"] for r in info["replicas"]}) == 2 and info["complete"], info
        assert httpx.get(dep.http_url + "/query_key", params={"key": "nope"}, timeout=5).status_code == 404


def filling_ten_times_the_capacity_never_fails(make_deployment: DeploymentMaker) -> None:
    """Putting 10 times the holders' capacity evicts, never fails; the newest object survives."""
    value = bytes(256 << 10)
    with make_deployment() as dep, fresh_client(dep) as client:
        total = 0
        i = 0
        while total < 10 * 2 * HOLDER_BYTES:
            client.put(f"fill{i}", value)
            total += len(value)
            i += 1
        assert client.get(f"fill{i - 1}") == bytearray(value)  # the newest survives


def _used(dep: Deployment) -> int:
    return sum(int(str(s["used"])) for s in dep.segments())


def abandoned_puts_are_reclaimed(make_deployment: DeploymentMaker) -> None:
    """A writer that starts a put and dies: its space is freed after put_timeout_s (1 s) and
    its late PutEnd is refused as reclaimed."""
    with make_deployment() as dep:
        # blocks of objects removed while leased are freed when their lease ends: wait for quiet
        wait_until(lambda: _used(dep) == 0)
        with RpcClient(CODEC, dep.endpoint) as rpc:
            rpc.call(p.PutStart("a-writer-that-dies", "abandoned", MIB, p.ReplicaConfig(replicas=2)))
            assert _used(dep) >= 2 * MIB
            wait_until(lambda: _used(dep) == 0)  # put_timeout_s = 1.0
            with raises(ObjectNotFound, match="reclaimed"):
                rpc.call(p.PutEnd("a-writer-that-dies", "abandoned"))


def regression_closing_a_client_on_a_shared_engine_returns_its_segment(make_deployment: DeploymentMaker) -> None:
    """The segment buffer of a client built on a caller's engine was never unregistered."""
    with make_deployment() as dep, TransferEngine() as engine:
        cfg = replace(Config(), client=ClientConfig(master=dep.endpoint, segment_bytes=MIB))
        StoreClient(cfg, engine=engine).close()
        assert engine.describe().buffers == []


def disk_tier_offload_read_promote_invalidate_restart(make_deployment: DeploymentMaker) -> None:
    """An object pushed out of memory moves to its holder's disk and any client reads it there
    byte-exact; a hit brings it back to memory; an upsert or a remove is never answered with
    the disk's old copy; a restarted holder registers its disk again and its copies return."""
    value, kept = os.urandom(100_000), os.urandom(50_000)
    with make_deployment() as dep, tempfile.TemporaryDirectory(prefix="tsukimi-ssd-") as directory:
        ssd = str(Path(directory) / "ssd")
        holder = dep.client(MIB, ssd_dir=ssd, ssd_bytes=64 * MIB)
        here = (holder.engine.name,)
        with fresh_client(dep) as client:
            client.put("cold", value, preferred=here)
            client.put("kept", kept, preferred=here)
            for i in range(48):  # 12 MiB: more than the pool
                client.put(f"hot{i}", bytes(256 << 10), upsert=True)
            wait_until(lambda: dep.copies("cold") == (0, 1) and dep.copies("kept") == (0, 1))
            assert client.get("cold") == bytearray(value)  # from the holder's disk...
            wait_until(lambda: dep.copies("cold") == (1, 1))  # ...and promoted by that hit
            assert client.get("cold") == bytearray(value) and client.disk_reads == 1
            client.put("cold", b"new", upsert=True)
            assert client.get("cold") == bytearray(b"new") and dep.copies("cold") == (1, 0)
            holder.close()  # the disk goes with it...
            assert client.get("kept") is None
            again = dep.client(MIB, ssd_dir=ssd, ssd_bytes=64 * MIB)  # ...and comes back
            assert again.disk is not None and dep.copies("kept") == (0, 1)
            assert client.get("kept") == bytearray(kept)
            assert client.remove("kept", force=True) and client.get("kept") is None
            assert again.disk is not None
            wait_until(lambda: not any(f.key == "kept" for f in again.disk.store.files()))  # type: ignore[union-attr]


def batch_get_into_needs_a_buffer_per_key(make_deployment: DeploymentMaker) -> None:
    """batch_get with fewer buffers than keys is refused, naming both counts."""
    with make_deployment() as dep, fresh_client(dep) as client, raises(InvalidArgument, match="2 keys but 1 buffers"):
        client.batch_get(["a", "b"], [bytearray(10)])


STORE_CHECKS: tuple[Callable[[DeploymentMaker], None], ...] = (
    byte_exact_round_trips_and_misses,
    reput_fails_upsert_replaces,
    remove_under_lease,
    replicas_on_distinct_segments,
    filling_ten_times_the_capacity_never_fails,
    abandoned_puts_are_reclaimed,
    regression_closing_a_client_on_a_shared_engine_returns_its_segment,
    disk_tier_offload_read_promote_invalidate_restart,
    batch_get_into_needs_a_buffer_per_key,
    *ADMIN_CHECKS,  # store_admin_checks.py: tasks, ranges, clearing, patterns
    *PARTS_CHECKS,  # store_parts_checks.py: objects made of several buffers
)


def check_store(make_deployment: DeploymentMaker) -> None:
    """Run every check of STORE_CHECKS against `make_deployment`, in order (pass
    `deployments.lend(dep)` to run them all on one deployment).

    Raises:
        AssertionError (or the store's own error) from the first check that fails, with a
        note naming it.
    """
    run_checks("store", STORE_CHECKS, make_deployment)
