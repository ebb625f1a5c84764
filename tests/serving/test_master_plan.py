"""The store masters `tsukimi up` plans (tsukimi/serving/cluster/master_plan.py): one master, or etcd
and `[master] ha` masters electing a leader, which the workers follow through etcd://."""

from __future__ import annotations

import itertools
from pathlib import Path

from tsukimi.config import ClusterConfig, load
from tsukimi.serving.cluster.up import plan


def test_one_master_without_ha() -> None:
    ports = itertools.count(7001)
    groups = plan(load(ClusterConfig, None, ["model=tiny"]), lambda: next(ports))
    assert [[s.name for s in g] for g in groups] == [["master", "metadata"], ["prefill-0", "decode-0"], ["router"]]
    assert groups[1][0].args[groups[1][0].args.index("--master") + 1] == "tcp://127.0.0.1:7001"


def test_ha_starts_etcd_then_the_masters_and_the_workers_follow_the_leader(tmp_path: Path) -> None:
    ports = itertools.count(7001)
    config = load(ClusterConfig, None, ["model=tiny", "master.ha=2", "master.etcd_port=2379", "master.rpc_port=5000"])
    groups = plan(config, lambda: next(ports), tmp_path)
    names = [[s.name for s in g] for g in groups]
    assert names == [["etcd"], ["master-0", "master-1", "metadata"], ["prefill-0", "decode-0"], ["router"]]
    [etcd] = groups[0]
    assert etcd.url == "http://127.0.0.1:2379" and etcd.health == "http"
    assert etcd.argv[0].endswith("etcd")
    assert f"--data-dir={tmp_path / 'etcd-data'}" in etcd.argv
    for master in groups[1][:2]:
        assert '--set=master.ha_etcd="etcd://127.0.0.1:2379"' in master.args
    assert "--set=master.rpc_port=5000" in groups[1][0].args
    for worker in groups[2]:
        assert worker.args[worker.args.index("--master") + 1] == "etcd://127.0.0.1:2379"
