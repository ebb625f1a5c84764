"""A `tsukimi up` plan placed on a lab's hosts: addresses rewritten to each owner's host, bind
settings to the process's own, what cannot be moved reported; and a small live placement."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest

from tsukimi.config import ClusterConfig, load
from tsukimi.errors import ConfigError
from tsukimi.lab import Lab, Topology
from tsukimi.lab.cluster import launch, place
from tsukimi.serving.cluster.launcher import LaunchConfig
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.cluster.up import plan

from .conftest import needs_namespaces

HOSTS = {"m": "10.0.0.1", "p": "10.0.0.2", "d": "10.0.0.3", "r": "10.0.0.4"}
PLACEMENT = {"master": "m", "metadata": "m", "prefill": "p", "decode": "d", "router": "r"}


class FakeHosts:
    def address(self, host: str, nic: int = 0) -> str:
        return HOSTS[host]

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", f"ns-{host}", *argv]

    def host_id(self, host: str) -> str:
        return f"lab/{host}"

    def namespace(self, host: str) -> str:
        return f"ns-{host}"


def _plan() -> list[list[ProcessSpec]]:
    ports = itertools.count(20000)
    return plan(load(ClusterConfig, None, ['model="tiny"']), port=lambda: next(ports))


def test_every_address_moves_to_its_owners_host() -> None:
    placed = place(FakeHosts(), _plan(), PLACEMENT)
    specs = {s.name: s for g in placed.groups for s in g}
    assert placed.hosts == {"master": "m", "metadata": "m", "prefill-0": "p", "decode-0": "d", "router": "r"}
    master, worker, router = specs["master"], specs["prefill-0"], specs["router"]
    assert '--set=master.host="10.0.0.1"' in master.args and master.url.startswith("http://10.0.0.1:")
    assert worker.args[worker.args.index("--host") + 1] == "10.0.0.2"
    assert worker.args[worker.args.index("--master") + 1].startswith("tcp://10.0.0.1:")
    assert "10.0.0.2" in router.args[router.args.index("--workers") + 1]
    assert router.argv[:4] == ("ip", "netns", "exec", "ns-r") and router.argv[-len(router.args) :] == router.args
    assert ("TSUKIMI_HOST_ID", "lab/p") in worker.env
    assert not any("127.0.0.1" in w for s in specs.values() for w in (*s.args, s.url))
    assert placed.missing == ()  # a worker's store client serves on the worker's --host


def test_a_holders_transfer_bind_host_moves_to_its_own_host() -> None:
    """Regression: `transfer.bind_host` (a holder's segment server) was no bind setting to
    `place`: it stayed on 127.0.0.1, where no other host reaches it."""
    from tsukimi.testing.lab_store import store_plan

    placed = place(FakeHosts(), store_plan(2), {"master": "m", "holder-0": "p", "holder-1": "d"})
    specs = {s.name: s for g in placed.groups for s in g}
    assert placed.missing == ()
    assert '--set=master.host="10.0.0.1"' in specs["master"].args
    assert '--set=transfer.bind_host="10.0.0.2"' in specs["holder-0"].args
    assert '--set=transfer.bind_host="10.0.0.3"' in specs["holder-1"].args
    assert specs["holder-1"].args[specs["holder-1"].args.index("--master") + 1] == "tcp://10.0.0.1:50051"


def test_a_process_without_a_host_is_named() -> None:
    with pytest.raises(ConfigError, match=r"no host for router \(router\)"):
        place(FakeHosts(), _plan(), {k: v for k, v in PLACEMENT.items() if k != "router"})


@needs_namespaces
def test_a_master_and_a_metadata_server_on_two_hosts_checked_from_a_third(tmp_path: Path) -> None:
    groups = [g for g in _plan() if all(s.role in ("master", "metadata") for s in g)]
    with Lab(Topology.of("m", "n", "ctl")) as lab:
        placed = place(lab, groups, {"master": "m", "metadata": "n"})
        cluster = launch(lab, placed, LaunchConfig(tmp_path, startup_timeout_s=60), control="ctl")
        try:
            assert {p.name: p.url.split("//")[1].split(":")[0] for p in cluster.processes} == {
                "master": lab.address("m"),
                "metadata": lab.address("n"),
            }
        finally:
            cluster.stop()


@needs_namespaces
@pytest.mark.timeout(180)
def test_pd_serving_with_prefill_and_decode_on_different_hosts_gives_one_hosts_tokens(tmp_path: Path) -> None:
    """The whole plan spread over five hosts (master + metadata, prefill, decode, router, a
    client): the prompt's KV goes prefill host -> pool -> decode host over tcp, and the greedy
    tokens are those of the model run in one process."""
    import httpx

    from tsukimi.engine.model import generate_greedy_reference
    from tsukimi.engine.weights import random_tiny

    prompt, new = list(range(5, 5 + 70)), 8  # 4 full blocks of 16 travel through the pool
    expected = list(generate_greedy_reference(random_tiny(0).model, prompt, new))
    with Lab(Topology.of("m", "p", "d", "r", "client")) as lab:
        placed = place(lab, _plan(), PLACEMENT)
        assert placed.missing == ()
        cluster = launch(lab, placed, LaunchConfig(tmp_path, startup_timeout_s=120), control="client")
        try:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
            body["return_token_ids"] = True
            with lab.entered("client"):
                answer = httpx.post(cluster.api + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == expected
            assert lab.address("r") in cluster.api
        finally:
            cluster.stop()
