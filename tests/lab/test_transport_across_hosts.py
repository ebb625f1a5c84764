"""The transport conformance suite between two emulated hosts: the target engine in a process
of host b (tsukimi/testing/target_peer.py), the checks and the initiator in host a (this
thread inside a's network), the metadata server on a third host; over tcp, each check its own
test. Then tcp striping over two NICs: byte-exact, and both links carried the bytes (the
kernel's counters of each NIC, read inside the namespaces)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tsukimi.lab import HOST_ID_ENV, HostSpec, Lab, LinkShape, Topology
from tsukimi.lab.counters import nic_bytes
from tsukimi.testing.assertions import check_name
from tsukimi.testing.engine_pairs import MIB, PairMaker, initiator_config
from tsukimi.testing.host_pairs import RemoteTarget, host_pair_maker
from tsukimi.testing.lab_services import start_metadata_server, worker_in
from tsukimi.testing.processes import JsonWorker
from tsukimi.testing.transport_checks import TRANSPORT_CHECKS
from tsukimi.transfer import TransferEngine

from .conftest import needs_namespaces

pytestmark = [needs_namespaces, pytest.mark.timeout(120)]

CHECKOUT = Path(__file__).resolve().parents[2]  # NOTE: first on the peers' path: they run the code under test
TWO_NICS = (LinkShape(),) * 2  # 1 Gbit/s each
TOPOLOGY = Topology((HostSpec("a", TWO_NICS), HostSpec("b", TWO_NICS), HostSpec("meta", (LinkShape(),))))


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(TOPOLOGY) as made:
        yield made


@pytest.fixture(scope="module")
def metadata_url(lab: Lab) -> str:
    return start_metadata_server(lab, "meta")


@pytest.fixture(scope="module")
def peer(lab: Lab, metadata_url: str) -> Iterator[JsonWorker]:
    worker = worker_in(lab, "b", "target", ["tsukimi.testing.target_peer", metadata_url], pythonpath=[CHECKOUT])
    yield worker
    worker.stop()


@pytest.fixture(autouse=True)
def _host_a(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's engines are host a's (the peer is b's): never the same host."""
    monkeypatch.delenv("TSUKIMI_CLUSTER_SECRET", raising=False)
    monkeypatch.setenv(HOST_ID_ENV, lab.host_id("a"))


@pytest.mark.parametrize("check", TRANSPORT_CHECKS, ids=check_name)
@pytest.mark.parametrize("case", ["tcp-1", "tcp-4"])
def test_transport_between_hosts(
    lab: Lab, metadata_url: str, peer: JsonWorker, case: str, check: Callable[[PairMaker], None]
) -> None:
    assert peer.ready["host_id"] == lab.host_id("b")
    with lab.entered("a"):
        check(host_pair_maker(peer, case, metadata_url, bind_host=lab.address("a"), target_host=lab.address("b")))


def test_tcp_stripes_over_two_nics_byte_exact(lab: Lab, metadata_url: str, peer: JsonWorker) -> None:
    """Both hosts serve on both NICs: the 4 connections go 2 per NIC, and each NIC of each
    host carries at least a quarter of the bytes both ways (halves, give or take)."""
    size = 64 * MIB
    data = np.random.default_rng(24).integers(0, 256, size, dtype=np.uint8)
    back = np.zeros(size, np.uint8)
    target = RemoteTarget(peer)
    try:
        opened, buf = target.open(",".join(lab.addresses("b")), size)
        config = initiator_config("tcp-4", metadata_url, bind_host=",".join(lab.addresses("a")), slice_bytes=MIB)
        before = {host: nic_bytes(lab, host) for host in ("a", "b")}
        with lab.entered("a"), TransferEngine("striper", config) as engine:
            segment = engine.open_segment(str(opened["name"]))
            assert [e.host for e in engine.lookup(segment.name).endpoints] == lab.addresses("b")
            engine.write(segment, buf.base, data)
            assert np.array_equal(np.frombuffer(buf.view, np.uint8), data), "the owner's memory differs"
            engine.read(segment, buf.base, back)
        moved = {host: nic_bytes(lab, host) - before[host] for host in ("a", "b")}
    finally:
        target.close()
    assert np.array_equal(back, data)
    for nic in ("eth0", "eth1"):
        sent, received = moved["a"][nic], moved["b"][nic]
        assert min(sent.tx_bytes, sent.rx_bytes, received.tx_bytes, received.rx_bytes) > size // 4, moved
    assert moved["a"].tx_bytes >= size and moved["a"].rx_bytes >= size, moved
