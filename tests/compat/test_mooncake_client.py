"""`tsukimi compat mooncake-client` (the standalone client holding the memory) and Mooncake's
dummy clients (`setup_dummy`, `alloc_from_mem_pool`) that join the store through it."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

import pytest

from tsukimi.compat.mooncake import dummy as dummy_module
from tsukimi.compat.mooncake.client_flags import parse
from tsukimi.compat.mooncake.client_service import ClientService
from tsukimi.compat.mooncake.store import MooncakeDistributedStore
from tsukimi.errors import ConfigError
from tsukimi.netio import free_port
from tsukimi.store.master.server import MasterServer

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


def flags(master: MasterServer, port: int, *extra: str) -> list[str]:
    address = master.endpoint.removeprefix("tcp://")
    return [
        "--host=127.0.0.1",
        f"--port={port}",
        f"--master_server_address={address}",
        "--metadata_server=P2PHANDSHAKE",
        "--global_segment_size=16MB",
        *extra,
    ]


def test_the_flags_are_mooncake_clients() -> None:
    parsed = parse(
        [
            "--host",
            "127.0.0.1",
            "--port=50099",
            "--global_segment_size=1 GB",
            "--threads=4",
            "--enable_http_server",
            "--master_server_address=m:1",
        ]
    )
    assert parsed.port == 50099 and parsed.setup.global_segment_size == 1 << 30 and parsed.setup.port == 0
    assert parsed.setup.master == "tcp://m:1" and parsed.ignored == ["threads", "enable_http_server"]
    assert parse([]).setup.global_segment_size == 4 << 30  # Mooncake's default
    for bad in (["--no_such_flag=1"], ["--enable_offload"], ["--port=0"], ["--global_segment_size=50%"], ["host"]):
        with pytest.raises(ConfigError):
            parse(bad)


def test_a_dummy_client_stores_into_the_standalone_clients_memory(master: MasterServer) -> None:
    parsed = parse(flags(master, free_port()))
    service = ClientService(parsed.setup, parsed.port)
    dummy = MooncakeDistributedStore()
    try:
        assert dummy.setup_dummy(32 * MIB, 16 * MIB, f"127.0.0.1:{parsed.port}") == 0
        assert dummy.get_hostname() == ""
        assert dummy.put("k", b"hello") == 0 and dummy.get("k") == b"hello"
        [replica] = dummy.get_replica_desc("k")
        assert replica.get_memory_descriptor().buffer_descriptor.transport_endpoint == service.client.engine.name
        ptr = dummy.alloc_from_mem_pool(4096)
        assert ptr and dummy.alloc_from_mem_pool(4096) == ptr + 4096 and dummy.alloc_from_mem_pool(64 * MIB) == 0
        assert dummy.register_buffer(ptr, 4096) == 0
        assert dummy.get_into("k", ptr, 4096) == 5 and ctypes.string_at(ptr, 5) == b"hello"
        assert dummy.put_from("k2", ptr, 5) == 0 and service.client.get("k2") == bytearray(b"hello")
        assert dummy.put("big", bytes(17 * MIB)) == -600  # over the 16 MiB local buffer
    finally:
        dummy.close()
        service.close()
    assert MooncakeDistributedStore().alloc_from_mem_pool(64) == 0  # not a dummy client


def test_setup_dummy_without_a_standalone_client_fails_with_a_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dummy_module, "HELLO_TIMEOUT_S", 0.3)  # NOTE: 5 s by default, as Mooncake waits
    store = MooncakeDistributedStore()
    assert store.setup_dummy(MIB, MIB, f"127.0.0.1:{free_port()}") < 0
    assert store.setup_dummy(MIB, MIB, "no-port") == -600
    assert store.setup_dummy(-1, MIB, "127.0.0.1:1") == -600


def test_the_command_serves_until_sigterm(master: MasterServer) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "tsukimi.cli", "compat", "mooncake-client", *flags(master, port, "--threads=2")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]  # a warning naming --threads, then ready
        assert "ignored: threads" in lines[0] and "16777216 bytes mounted" in lines[1], lines
        dummy = MooncakeDistributedStore()
        assert dummy.setup_dummy(0, MIB, f"127.0.0.1:{port}") == 0
        assert dummy.put("k", b"v") == 0 and dummy.get("k") == b"v"
        dummy.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        proc.wait()
