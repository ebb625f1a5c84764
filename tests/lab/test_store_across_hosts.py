"""The store semantics suite on a store spread over five emulated hosts: the master on one,
a holder on each of three others, the suite's clients on a fifth (this thread inside it),
every segment reached over tcp (tsukimi/testing/lab_store.py). Then replicas land on distinct
hosts, and a holder's host partitioned from all the others loses no acknowledged object:
each is read byte-exact from its other replica, and after the partition heals the holder
mounts again and serves new replicas."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import httpx
import pytest

from tsukimi.lab import HOST_ID_ENV, Lab, Topology
from tsukimi.testing.assertions import check_name
from tsukimi.testing.deployments import DeploymentMaker, lend
from tsukimi.testing.lab_store import SpreadStore, start_spread_store
from tsukimi.testing.processes import wait_until
from tsukimi.testing.store_checks import STORE_CHECKS

from .conftest import needs_namespaces

pytestmark = [needs_namespaces, pytest.mark.timeout(120)]

HOLDERS = ("h1", "h2", "h3")
CLIENT = "c"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(Topology.of("m", *HOLDERS, CLIENT)) as made:
        yield made


@pytest.fixture(scope="module")
def store(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpreadStore]:
    with lab.entered(CLIENT):
        started = start_spread_store(lab, "m", HOLDERS, CLIENT, tmp_path_factory.mktemp("spread-store"))
        try:
            yield started
        finally:
            started.close()


@pytest.fixture(autouse=True)
def _host_c(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's clients are host c's."""
    monkeypatch.delenv("TSUKIMI_CLUSTER_SECRET", raising=False)
    monkeypatch.setenv(HOST_ID_ENV, lab.host_id(CLIENT))


def test_every_process_serves_on_its_own_host(lab: Lab, store: SpreadStore) -> None:
    assert [name.rsplit(":", 1)[0] for name in store.deployment.holder_names] == [lab.address(h) for h in HOLDERS]
    assert store.deployment.endpoint.startswith(f"tcp://{lab.address('m')}:")


@pytest.mark.parametrize("check", STORE_CHECKS, ids=check_name)
def test_store_across_hosts(lab: Lab, store: SpreadStore, check: Callable[[DeploymentMaker], None]) -> None:
    with lab.entered(CLIENT):
        check(lend(store.deployment))


def _hosts_of(store: SpreadStore, key: str) -> list[str]:
    """The hosts of `key`'s memory replicas, by the master's /query_key, sorted."""
    info = httpx.get(store.deployment.http_url + "/query_key", params={"key": key}, timeout=5).json()
    return sorted(store.holder_host(r["te_segment"]) for r in info["replicas"])


def test_a_holders_host_partitioned_then_healed_loses_no_acknowledged_object(lab: Lab, store: SpreadStore) -> None:
    """Replicas land on distinct hosts; h1 cut off from every other host: once the master has
    dropped it (client_ttl_s = 2 s), every acknowledged object reads back byte-exact from its
    other replica and new puts go to h2 and h3; healed, h1 mounts again and takes replicas."""
    dep = store.deployment
    values = {f"obj{i}": os.urandom(200_000) for i in range(12)}
    with lab.entered(CLIENT):
        client = dep.client()
        try:
            client.put("everywhere", b"3" * 100_000, replicas=3)
            assert _hosts_of(store, "everywhere") == list(HOLDERS)
            for key, value in values.items():
                client.put(key, value, replicas=2)
            placed = {key: _hosts_of(store, key) for key in values}
            assert all(len(set(hosts)) == 2 for hosts in placed.values()), placed
            assert any("h1" in hosts for hosts in placed.values()), placed

            for other in ("m", "h2", "h3", CLIENT):
                lab.partition("h1", other)
            wait_until(lambda: len(dep.segments()) == 2, timeout_s=15)
            for key, value in values.items():
                assert client.get(key) == bytearray(value), f"{key} (was on {placed[key]})"
                assert _hosts_of(store, key) == [h for h in placed[key] if h != "h1"]
            client.put("during", b"d" * 100_000, replicas=2)
            assert _hosts_of(store, "during") == ["h2", "h3"]

            lab.heal()
            wait_until(lambda: len(dep.segments()) == 3, timeout_s=15)
            client.put("after", b"a" * 100_000, replicas=3)
            assert _hosts_of(store, "after") == list(HOLDERS)
            assert client.get("after") == bytearray(b"a" * 100_000)
            assert all(client.get(key) == bytearray(value) for key, value in values.items())
        finally:
            lab.heal()
            client.remove_all(force=True)
