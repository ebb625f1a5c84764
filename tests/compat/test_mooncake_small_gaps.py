"""Small gaps of the Mooncake facade, closed: setup's two overloads (`setup(config=...)`
included), `store.bind_to_numa_node`, `mooncake.cli` / `cli_client` (running tsukimi's
commands, under `tsukimi compat exec` too), `infer_structure`'s private `_depth`."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

import pytest

from tests.compat.surface_diff import load_surface
from tsukimi.compat.commands import run_with_mooncake
from tsukimi.compat.mooncake import cli, cli_client, numa, setup_args
from tsukimi.compat.mooncake.store import MooncakeDistributedStore, bind_to_numa_node
from tsukimi.compat.mooncake.structured_object_store import MAX_DEPTH, infer_structure
from tsukimi.store.master.server import MasterServer

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20
LINUX_NUMA = pytest.mark.skipif(
    not numa.online_nodes() or os.uname().machine not in ("x86_64", "aarch64"),
    reason="needs Linux NUMA sysfs (/sys/devices/system/node) on x86_64 or aarch64",
)


def test_setup_binds_both_of_mooncakes_forms() -> None:
    config: dict[str, object] = {"local_hostname": "h", "metadata_server": "P2PHANDSHAKE"}
    assert setup_args.bind((), {"config": config}).config == config
    assert setup_args.bind((config,), {}).config == config
    by_keyword = setup_args.bind((), {"local_hostname": "h", "metadata_server": "P2PHANDSHAKE", "engine": 5})
    assert by_keyword.config is None and by_keyword.engine == 5
    assert by_keyword.arguments["local_hostname"] == "h" and "engine" not in by_keyword.arguments
    mixed = setup_args.bind(("h", "P2PHANDSHAKE", 1024), {"protocol": "rdma", "enable_client_http_server": True})
    assert mixed.arguments["global_segment_size"] == 1024 and mixed.arguments["protocol"] == "rdma"
    assert mixed.client_http_server and not by_keyword.client_http_server
    for args, kwargs in (
        ((config, "P2PHANDSHAKE"), {}),
        ((), {"config": config, "protocol": "tcp"}),
        ((), {"config": "not a dictionary"}),
        ((), {"foo": 1}),
        (("h",) * 14, {}),
    ):
        with pytest.raises(TypeError):
            setup_args.bind(args, kwargs)


def test_setup_binds_every_call_the_wheel_s_recorded_overloads_take() -> None:
    # NOTE: setup is (*args, **kwargs), as the wheel's: the surface test cannot hold it to the overloads
    setup = load_surface()["mooncake.store"]["names"]["MooncakeDistributedStore"]["attrs"]["setup"]  # type: ignore[index]
    values = {"config": {"local_hostname": "h"}, "engine": None}
    for params in setup["sigs"]:
        names = [p["name"] for p in params]
        by_position = setup_args.bind(tuple(values.get(n, "x") for n in names), {})
        by_keyword = setup_args.bind((), {n: values.get(n, "x") for n in names})
        assert by_position == by_keyword and (by_keyword.config is None) == ("config" not in names)


def test_setup_takes_the_config_by_keyword(module_master: MasterServer) -> None:
    address = module_master.endpoint.removeprefix("tcp://")
    config: dict[str, object] = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "16MB",
        "master_server_addr": address,
    }
    store = MooncakeDistributedStore()
    assert store.setup(config=config) == 0
    assert store.put("k", b"v" * 1000) == 0 and store.get("k") == b"v" * 1000
    assert store.close() == 0
    keywords = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "master_server_addr": address}
    assert store.setup(**keywords, global_segment_size=16 * MIB, local_buffer_size=MIB, protocol="tcp") == 0
    assert store.put("k2", b"w" * 1000) == 0 and store.get("k2") == b"w" * 1000
    assert store.close() == 0
    assert MooncakeDistributedStore().setup(config={"local_hostname": "127.0.0.1"}) == -600
    with pytest.raises(TypeError):
        MooncakeDistributedStore().setup(config=config, local_hostname="127.0.0.1")


def _in_a_thread(call: Callable[[], object]) -> object:
    """`call`'s result, run in a fresh thread (so the bindings stay off the test's thread)."""
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(call()))
    worker.start()
    worker.join()
    return results[0]


@LINUX_NUMA
def test_bind_to_numa_node_pins_the_thread_and_prefers_the_node_s_memory() -> None:
    node = min(numa.online_nodes())
    cpus = numa.node_cpus(node)

    def bind_and_read() -> tuple[set[int], numa.MemoryPolicy]:
        bind_to_numa_node(node)
        return os.sched_getaffinity(0), numa.memory_policy()

    assert _in_a_thread(bind_and_read) == (cpus, numa.MemoryPolicy(numa.MPOL_PREFERRED, frozenset({node})))


@LINUX_NUMA
def test_bind_to_a_missing_node_warns_and_binds_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def bind_and_read() -> tuple[set[int], numa.MemoryPolicy]:
        before = os.sched_getaffinity(0), numa.memory_policy()
        bind_to_numa_node(999)
        assert (os.sched_getaffinity(0), numa.memory_policy()) == before
        bind_to_numa_node(-5)  # below -1 (unbind) is no node either
        assert (os.sched_getaffinity(0), numa.memory_policy()) == before
        return before

    _in_a_thread(bind_and_read)
    assert "Invalid NUMA node: 999. Valid range: " in caplog.text
    assert "numa_run_on_node failed for node 999" in caplog.text and "Invalid argument" in caplog.text
    assert "Invalid NUMA node: -5" in caplog.text
    with pytest.raises(TypeError):
        bind_to_numa_node("0")  # type: ignore[arg-type]


def test_the_cli_modules_exec_tsukimi_s_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append([path, *argv]))
    monkeypatch.setattr(sys, "argv", ["mooncake_master", "--rpc_port=50051", "--enable_http_metadata_server=true"])
    cli.main()
    monkeypatch.setattr(sys, "argv", ["mooncake_client", "--port=50052"])
    cli_client.main()
    tsukimi = [sys.executable, sys.executable, "-m", "tsukimi.cli", "compat"]
    assert calls == [
        [*tsukimi, "mooncake-master", "--rpc_port=50051", "--enable_http_metadata_server=true"],
        [*tsukimi, "mooncake-client", "--port=50052"],
    ]


def test_python_m_mooncake_cli_under_compat_exec_is_tsukimi_s_master(capfd: pytest.CaptureFixture[str]) -> None:
    # NOTE: what `tsukimi compat exec -- CMD` runs, called here to spare CI one interpreter
    assert run_with_mooncake([sys.executable, "-m", "mooncake.cli", "--no_such_flag=1"]) == 2
    out, err = capfd.readouterr()
    assert "mooncake_master" in out + err and "rpc_port" in out + err


def test_infer_structure_s_private_depth_is_the_wheel_s() -> None:
    with pytest.raises(ValueError, match="nests deeper"):
        infer_structure("r", [1], [], [], _depth=MAX_DEPTH + 1)
