"""`mooncake.engine` on tsukimi: Mooncake's names, signatures and return conventions (0 or a
negative code, batch ids with 0 for failure), over p2p and over a metadata backend.

Mooncake's own transfer_engine_initiator_test.py runs against this facade through
../shared/mooncake-tests/run.sh beside the checkout (with -p tests.compat.mooncake_te_target)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tsukimi.compat.mooncake import engine as mc
from tsukimi.compat.mooncake.engine_setup import engine_setup
from tsukimi.errors import ConfigError, OutOfBounds

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


def _started(metadata: str = "P2PHANDSHAKE") -> mc.TransferEngine:
    engine = mc.TransferEngine()
    assert engine.initialize("127.0.0.1", metadata, "tcp", "") == 0
    return engine


@pytest.fixture
def pair() -> Iterator[tuple[mc.TransferEngine, mc.TransferEngine, str]]:
    """(initiator, target, the target's name) in p2p mode, as Mooncake's P2PHANDSHAKE."""
    initiator, target = _started(), _started()
    yield initiator, target, f"127.0.0.1:{target.get_rpc_port()}"
    initiator.close()
    target.close()


def test_module_names() -> None:
    assert (mc.TransferOpcode.Read, mc.TransferOpcode.Write) == (0, 1)
    assert (mc.Read, mc.Write) == (mc.TransferOpcode.Read, mc.TransferOpcode.Write)
    assert not (mc.SUPPORT_CUDA or mc.SUPPORT_EFA or mc.SUPPORT_INTRA_NVLINK)
    empty, note = mc.TransferNotify(), mc.TransferNotify("req", b"\xffdone")
    assert (empty.name, empty.msg) == ("", "")
    assert note.name == "req" and note.msg.encode("utf-8", "surrogateescape") == b"\xffdone"
    assert note == mc.TransferNotify("req", b"\xffdone") != empty


def test_initialize_arguments() -> None:
    p2p = engine_setup("10.0.0.5:12345", "P2PHANDSHAKE", "tcp")
    assert p2p.name is None and p2p.config.metadata.url == "p2p"
    assert (p2p.config.transfer.bind_host, p2p.config.transfer.port) == ("10.0.0.5", 12345)
    http = engine_setup("127.0.0.1:12345", "http://127.0.0.1:8080/metadata", "tcp")
    assert http.name == "127.0.0.1:12345" and http.config.metadata.url == "http://127.0.0.1:8080/metadata"
    assert http.config.transfer.port == 0 and http.config.transfer.transport == "auto"
    assert engine_setup("h", "127.0.0.1:2379", "tcp").config.metadata.url == "etcd://127.0.0.1:2379"
    ext = engine_setup("h", "127.0.0.1:8080/metadata", "tcp", "http")
    assert ext.config.metadata.url == "http://127.0.0.1:8080/metadata" and ext.name == "h"
    assert engine_setup("", "P2PHANDSHAKE", "rdma").config.transfer.nixl
    for args in [("h", "P2PHANDSHAKE", "nvlink"), ("h:port", "P2PHANDSHAKE", "tcp"), ("h", "redis://r:1", "tcp")]:
        with pytest.raises(ConfigError):
            engine_setup(*args)


def test_rdma_without_nixl_is_tcp_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang's default protocol is "rdma": without NIXL it must serve over tcp, not fail."""
    from tsukimi.compat.mooncake import rdma, setup_args

    monkeypatch.setattr(rdma, "nixl_installed", lambda: False)
    monkeypatch.setattr(rdma, "_warned", threading.Event())
    with caplog.at_level(logging.WARNING, logger=rdma.__name__):
        assert not engine_setup("", "P2PHANDSHAKE", "rdma").config.transfer.nixl
        store = setup_args.from_args("127.0.0.1", "P2PHANDSHAKE", 1 << 24, 1 << 22, "rdma", "", "127.0.0.1:50051")
        assert not store.nixl
        engine = mc.TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    assert [r.message for r in caplog.records].count(
        "protocol rdma: NIXL is not installed here (make nixl); using tcp"
    ) == 1
    monkeypatch.setattr(rdma, "nixl_installed", lambda: True)
    assert engine_setup("", "P2PHANDSHAKE", "rdma").config.transfer.nixl


def test_initialize_returns_codes() -> None:
    engine = mc.TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "bogus", "") == -1
    assert engine.initialize("127.0.0.1", "http://127.0.0.1:1/metadata", "tcp", "") == -1  # nobody there
    assert engine.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "") == 0
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # once per object
    engine.close()


def test_calls_before_initialize_fail_with_codes() -> None:
    engine = mc.TransferEngine()
    assert engine.transfer_sync_write("127.0.0.1:1", 1, 1, 1) == -1
    assert engine.batch_transfer_async_write("127.0.0.1:1", [1], [1], [1]) == 0
    assert engine.get_batch_transfer_status([1]) == -1 and engine.transfer_check_status(1) == -1
    assert engine.send_probe("127.0.0.1:1") == -1 and engine.register_memory(1, 1) == -1
    assert engine.allocate_managed_buffer(4096) == 0
    with pytest.raises(ConfigError):
        engine.read_bytes_from_buffer(1, 1)


def test_managed_buffers_and_local_bytes(pair: tuple[mc.TransferEngine, mc.TransferEngine, str]) -> None:
    initiator, _, _ = pair
    me = f"127.0.0.1:{initiator.get_rpc_port()}"
    assert initiator.get_first_buffer_address(me) == 0
    addr = initiator.allocate_managed_buffer(MIB)
    assert addr != 0 and initiator.get_first_buffer_address(me) == addr
    assert initiator.write_bytes_to_buffer(addr, b"hello world", 11) == 0
    assert initiator.write_bytes_to_buffer(addr, "HE", 2) == 0  # str, as pybind's std::string
    assert initiator.write_bytes_to_buffer(addr, b"abc", 1) == 0  # only `length` bytes
    assert initiator.read_bytes_from_buffer(addr, 11) == b"aEllo world"
    assert initiator.write_bytes_to_buffer(addr, b"hi", 5) == -1  # more than given
    assert initiator.write_bytes_to_buffer(addr + MIB - 1, b"hi", 2) == -3  # past the buffer
    with pytest.raises(OutOfBounds):
        initiator.read_bytes_from_buffer(addr + MIB, 1)
    assert initiator.allocate_managed_buffer(0) == 0
    assert initiator.free_managed_buffer(addr, MIB) == 0
    assert initiator.free_managed_buffer(addr, MIB) == -3
    assert initiator.get_first_buffer_address(me) == 0


def test_register_memory_codes(pair: tuple[mc.TransferEngine, mc.TransferEngine, str]) -> None:
    engine, _, _ = pair
    memory = ctypes.create_string_buffer(1 << 16)
    addr = ctypes.addressof(memory)
    assert engine.register_memory(addr, 1 << 15) == 0
    assert engine.register_memory(addr + 100, 1 << 15) == -7  # overlaps
    assert engine.register_memory(addr + (1 << 15), 0) == -1
    assert engine.register_memory(addr + (1 << 15), 16, "cuda:0") == -1
    # all or none: the second overlaps the first, so neither stays
    assert engine.batch_register_memory([addr + (1 << 15), addr + (1 << 15) + 8], [16, 16]) == -7
    assert engine.register_memory(addr + (1 << 15), 16) == 0
    assert engine.batch_unregister_memory([addr, 12345, addr + (1 << 15)]) == -3
    assert engine.unregister_memory(addr) == -3  # both went
    assert engine.batch_register_memory([addr], [16, 16]) == -1


def test_sync_transfers_and_notifications(pair: tuple[mc.TransferEngine, mc.TransferEngine, str]) -> None:
    initiator, target, name = pair
    src, dst = initiator.allocate_managed_buffer(MIB), target.allocate_managed_buffer(MIB)
    assert initiator.write_bytes_to_buffer(src, b"0123456789", 10) == 0
    assert initiator.transfer_sync_write(name, src, dst + 100, 10) == 0
    assert target.read_bytes_from_buffer(dst + 100, 10) == b"0123456789"
    assert initiator.transfer_sync_read(name, src + 500, dst + 100, 10) == 0
    assert initiator.read_bytes_from_buffer(src + 500, 10) == b"0123456789"
    assert initiator.batch_transfer_sync_write(name, [src, src + 5], [dst, dst + 50], [5, 5]) == 0
    assert target.read_bytes_from_buffer(dst, 5) == b"01234" and target.read_bytes_from_buffer(dst + 50, 5) == b"56789"
    assert initiator.transfer_sync(name, src, dst, 10, mc.Write, mc.TransferNotify("w", "written")) == 0
    assert initiator.batch_transfer_sync(name, [src], [dst], [4], mc.Read, mc.TransferNotify("r", "read")) == 0
    assert target.get_notifies() == [mc.TransferNotify("w", "written"), mc.TransferNotify("r", "read")]
    assert target.get_notifies() == [] and initiator.get_notifies() == []
    assert initiator.transfer_sync_write(name, src, dst + MIB, 10) == -1  # out of the peer's range
    assert initiator.transfer_sync(name, src, dst + MIB, 1, mc.Write, mc.TransferNotify("no", "")) == -1
    assert target.get_notifies() == []  # a failed transfer notifies nobody
    assert initiator.batch_transfer_sync_write(name, [src], [dst, dst], [1]) == -1
    assert initiator.batch_transfer_sync_write(name, [], [], []) == 0
    assert initiator.transfer_sync_write(name, src, dst, 10, "tcp") == 0  # a hint tsukimi has
    assert initiator.transfer_sync_write(name, src, dst, 10, "nvlink") == -1
    assert initiator.transfer_sync(name, src, dst, 1, 7) == -1  # no such opcode


def test_batch_ids(pair: tuple[mc.TransferEngine, mc.TransferEngine, str]) -> None:
    initiator, target, name = pair
    src, dst = initiator.allocate_managed_buffer(MIB), target.allocate_managed_buffer(MIB)
    assert initiator.write_bytes_to_buffer(src, b"async", 5) == 0
    batch_id = initiator.batch_transfer_async_write(name, [src, src], [dst, dst + 10], [5, 5])
    assert batch_id != 0 and initiator.get_batch_transfer_status([batch_id]) == 0
    assert target.read_bytes_from_buffer(dst + 10, 5) == b"async"
    assert initiator.get_batch_transfer_status([batch_id]) == -1  # freed
    read_id = initiator.batch_transfer_async(name, [src + 100], [dst + 10], [5], mc.Read)
    assert initiator.get_batch_transfer_status([read_id]) == 0
    assert initiator.read_bytes_from_buffer(src + 100, 5) == b"async"

    submitted = initiator.transfer_submit_write(name, src, dst + 20, 5)
    deadline = time.monotonic() + 10
    while (state := initiator.transfer_check_status(submitted)) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert state == 1 and target.read_bytes_from_buffer(dst + 20, 5) == b"async"
    assert initiator.transfer_check_status(submitted) == -1  # freed once it ended

    doomed = initiator.batch_transfer_async_write(name, [src, src], [dst, dst + MIB], [5, 5])  # one out of range
    assert doomed != 0 and initiator.get_batch_transfer_status([doomed]) == -1
    doomed = initiator.transfer_submit_write(name, src, dst + MIB, 5)
    while (state := initiator.transfer_check_status(doomed)) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert state == -1
    ok_id = initiator.transfer_submit_write(name, src, dst, 5)
    assert initiator.get_batch_transfer_status([ok_id, 999999]) == -1  # an unknown id fails the call
    assert initiator.get_batch_transfer_status([]) == 0


def test_unknown_peers(pair: tuple[mc.TransferEngine, mc.TransferEngine, str]) -> None:
    initiator, _, name = pair
    src = initiator.allocate_managed_buffer(MIB)
    assert initiator.batch_transfer_async_write("unreachable_peer:9", [0], [0], [16]) == 0
    assert initiator.transfer_submit_write("unreachable_peer:9", 0, 0, 16) == 0
    assert initiator.batch_transfer_async_write(name, [src], [0, 1], [16]) == 0  # lists of different lengths
    assert initiator.transfer_sync_write("unreachable_peer:9", src, 0, 16) == -1
    assert initiator.send_probe(name) == 0
    assert initiator.send_probe("unreachable_peer:9") == -101  # does not resolve
    assert initiator.send_probe("127.0.0.1:1") == -102  # refused
    assert initiator.get_first_buffer_address("127.0.0.1:1") == 0


def test_with_a_metadata_server() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    target, initiator = mc.TransferEngine(), mc.TransferEngine()
    assert target.initialize("127.0.0.1:12345", url, "tcp", "") == 0
    assert initiator.initialize("127.0.0.1:12347", url, "tcp", "") == 0
    try:
        assert target.get_local_hostname() == "127.0.0.1:12345"
        assert initiator.get_first_buffer_address("127.0.0.1:12345") == 0
        dst = target.allocate_managed_buffer(MIB)
        assert initiator.get_first_buffer_address("127.0.0.1:12345") == dst  # fetched anew
        src = initiator.allocate_managed_buffer(MIB)
        assert initiator.write_bytes_to_buffer(src, b"md", 2) == 0
        assert initiator.transfer_sync("127.0.0.1:12345", src, dst, 2, mc.Write, mc.TransferNotify("k", "v")) == 0
        assert target.read_bytes_from_buffer(dst, 2) == b"md" and target.get_notifies() == [mc.TransferNotify("k", "v")]
        assert initiator.send_probe("127.0.0.1:12345") == 0
        assert initiator.send_probe("unreachable_peer:9") == -200  # not published
        assert initiator.batch_transfer_async_write("unreachable_peer:9", [src], [0], [16]) == 0
    finally:
        initiator.close()
        target.close()


def test_device_pointers_register_and_move(pair: tuple[mc.TransferEngine, mc.TransferEngine, str]) -> None:
    """GPU memory as SGLang's PD backend and vLLM's MooncakeConnector hand it over: raw device
    pointers, location "*" (found out) or "cuda:N"-style names; here the emulated device."""
    from tsukimi.device import EMULATED, EmulatedDevice

    initiator, target, name = pair
    with EmulatedDevice(0).alloc(MIB) as local, EmulatedDevice(1).alloc(MIB) as remote:
        src, dst = local.range.address, remote.range.address
        assert initiator.register_memory(src, MIB, "*") == 0
        assert target.register_memory(dst, MIB, "emu:1") == 0
        assert initiator.write_bytes_to_buffer(src, b"on the device", 13) == 0
        before = EMULATED.stats["copy_bytes"] + EMULATED.stats["from_host_bytes"]
        assert initiator.transfer_sync_write(name, src, dst + 64, 13) == 0
        assert EMULATED.stats["copy_bytes"] + EMULATED.stats["from_host_bytes"] > before
        assert target.read_bytes_from_buffer(dst + 64, 13) == b"on the device"
        assert remote.read(64, 13) == b"on the device"
        assert initiator.transfer_sync_read(name, src + 100, dst + 64, 13) == 0
        assert local.read(100, 13) == b"on the device"
        assert target.register_memory(dst + MIB // 2, 16, "cpu:0") == -7  # overlaps the registered range
        assert initiator.unregister_memory(src) == 0 and target.unregister_memory(dst) == 0
