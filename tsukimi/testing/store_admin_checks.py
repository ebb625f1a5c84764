"""Store semantics checks of the calls beyond put/get/remove (part of the store semantics
suite: store_checks.py runs them after its own): copy and move tasks carried out by the
holders, range reads, multi-part puts, values read into the caller's buffers, clearing one
holder's replicas, removing by pattern, describing keys.

Same contract as store_checks: a DeploymentMaker with deployments.MASTER's timeouts and at
least two holders (the checks use the first two); each check removes what it stored.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tsukimi.errors import InvalidArgument
from tsukimi.store.client import StoreClient
from tsukimi.store.ranges import RangeRead
from tsukimi.testing.deployments import DeploymentMaker
from tsukimi.testing.deployments import fresh_client as _client

TASK_TIMEOUT_S = 10.0


def _holders(client: StoreClient, key: str) -> list[str]:
    info = client.describe([key])[0]
    assert info is not None, f"{key!r} is gone"
    return [r.te_segment for r in info.replicas]


def copy_and_move_tasks_run_on_the_holders(make_deployment: DeploymentMaker) -> None:
    """A copy adds a replica on the other holder and a move relocates one, each carried out by
    the target holder; the bytes read back exactly from the new replica alone."""
    data = np.random.default_rng(7).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    with make_deployment() as dep, _client(dep) as client:
        first, second = dep.holder_names[:2]
        client.put("copied", data, preferred=[first])
        info = client.wait_task(client.copy("copied", [second]), TASK_TIMEOUT_S)
        assert (info.kind, info.status, info.message) == ("copy", "succeeded", ""), info
        assert _holders(client, "copied") == [first, second]
        client.put("moved", data, preferred=[first])
        info = client.wait_task(client.move("moved", first, second), TASK_TIMEOUT_S)
        assert info.status == "succeeded", info
        assert _holders(client, "moved") == [second]
        assert client.get("moved") == bytearray(data)  # from the new replica: the old one is gone
        assert client.wait_task(client.copy("moved", [second])).message == "every target holds a replica already"


def range_reads_and_multi_part_puts(make_deployment: DeploymentMaker) -> None:
    """put_parts stores the parts' concatenation; get_ranges reads byte ranges of several
    objects into slices of one buffer; a miss and a range past the end come back as such."""
    with make_deployment() as dep, _client(dep) as client:
        client.put_parts("parts", [b"0123", bytearray(b"4567"), memoryview(b"89")])
        client.put("other", b"abcdefghij")
        buf = bytearray(16)
        view = memoryview(buf)
        got = client.get_ranges(
            [
                RangeRead("parts", 2, view[0:4]),
                RangeRead("other", 7, view[4:7]),
                RangeRead("missing", 0, view[8:9]),
                RangeRead("other", 8, view[10:14]),
            ]
        )
        assert buf[:7] == b"2345hij" and [r.size for r in got[:2]] == [4, 3]
        assert not got[2].found and got[2].error is None
        assert isinstance(got[3].error, InvalidArgument) and buf[10:14] == bytes(4)


def values_are_read_into_buffers_the_caller_allocates(make_deployment: DeploymentMaker) -> None:
    """batch_get(allocate=) reads each value into a buffer of the caller's bytearray type."""

    class Tagged(bytearray):
        pass

    with make_deployment() as dep, _client(dep) as client:
        client.put("a", b"alpha")
        found, missing = client.batch_get(["a", "nope"], allocate=Tagged)
        assert isinstance(found.data, Tagged) and found.data == b"alpha" and missing.data is None


def clearing_one_holder_and_removing_by_pattern(make_deployment: DeploymentMaker) -> None:
    """Clearing one holder's replica keeps the object on the other; clearing the last one
    removes it; a pattern removes exactly the keys it matches."""
    with make_deployment() as dep, _client(dep) as client:
        first, second = dep.holder_names[:2]
        client.put("twice", b"x" * 1000, replicas=2, preferred=[first, second])
        assert client.clear_replicas(["twice", "nope"], first) == ["twice"]
        holders = _holders(client, "twice")
        assert holders == [second], f"after clearing {first}: {holders} (holders {dep.holder_names})"
        assert client.get("twice") == bytearray(b"x" * 1000)
        client.remove("twice", force=True)
        for key in ("job/1", "job/2", "keep/1"):
            client.put(key, b"v")
        assert client.clear_replicas(["job/1"]) == ["job/1"] and not client.exists("job/1")
        assert client.remove_matching(r"^job/") == 1
        assert client.describe(["job/2", "keep/1"])[0] is None and client.exists("keep/1")


ADMIN_CHECKS: tuple[Callable[[DeploymentMaker], None], ...] = (
    copy_and_move_tasks_run_on_the_holders,
    range_reads_and_multi_part_puts,
    values_are_read_into_buffers_the_caller_allocates,
    clearing_one_holder_and_removing_by_pattern,
)
