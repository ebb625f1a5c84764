"""A holder's disk directory (`tsukimi.store.disk.DiskStore`) and its disk server: versions
kept apart, chunked and checked reads, capacity, one process per directory, and the scan at
start that keeps only whole, matching files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsukimi.errors import ChecksumMismatch, ConfigError, InvalidArgument, ObjectNotFound, OutOfSpace, TransferError
from tsukimi.store.disk import DiskStore, file_name
from tsukimi.store.disk_protocol import DiskLocation
from tsukimi.store.disk_server import DiskReader, DiskServer


def test_versions_of_a_key_are_separate_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    store.write("k", 1, memoryview(b"old"))
    store.write("k", 2, memoryview(b"newer"))
    out = bytearray(3)
    store.read_checked("k", 1, memoryview(out))
    assert out == b"old" and store.info("k", 2) is not None and store.used_bytes == 8
    with pytest.raises(ObjectNotFound):
        store.read_checked("k", 3, memoryview(bytearray(3)))  # a version it does not have
    assert store.delete("k", 1) and not store.delete("k", 1)
    assert [(f.key, f.put_id, f.size) for f in store.files()] == [("k", 2, 5)]
    store.close()


def test_capacity_bad_keys_and_one_process_per_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        DiskStore(tmp_path, 0)
    store = DiskStore(tmp_path, 10)
    with pytest.raises(OutOfSpace):
        store.write("big", 1, memoryview(bytes(11)))
    with pytest.raises(InvalidArgument):
        store.write("", 1, memoryview(b"x"))
    assert store.used_bytes == 0 and store.files() == []
    with pytest.raises(ConfigError, match="in use"):
        DiskStore(tmp_path, 10)
    store.close()
    DiskStore(tmp_path, 10).close()  # free again


def test_a_restart_keeps_whole_files_and_the_disk_id(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 10_000)
    disk_id = store.disk_id
    for i in range(4):
        store.write(f"k{i}", 7, memoryview(bytes([i]) * 100))
    store.close()
    (tmp_path / file_name("k0", 7)).write_bytes(b"TSKD")  # torn
    path = tmp_path / file_name("k1", 7)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # corrupt
    path.write_bytes(data)
    (tmp_path / file_name("k2", 7)).rename(tmp_path / file_name("k2", 8))  # renamed: name and header disagree
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / ".x.tmp").write_bytes(b"leftover")
    again = DiskStore(tmp_path, 10_000, verify=True)
    assert again.disk_id == disk_id
    assert [(f.key, f.put_id) for f in again.files()] == [("k3", 7)] and again.used_bytes == 100
    assert sorted(p.name for p in tmp_path.glob("??/*")) == [Path(file_name("k3", 7)).name]
    again.close()


def test_a_corrupt_file_is_caught_when_read(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1000)
    store.write("k", 1, memoryview(b"value"))
    path = tmp_path / file_name("k", 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    with pytest.raises(ChecksumMismatch):
        store.read_checked("k", 1, memoryview(bytearray(5)))
    assert store.info("k", 1) is None and not path.exists()
    store.close()


def test_the_disk_server_serves_chunks_and_the_reader_checks_the_whole(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 64 << 20)
    value = os.urandom((16 << 20) + 12345)  # more than one chunk
    store.write("big", 5, memoryview(value))
    server = DiskServer(store, "127.0.0.1")
    reader = DiskReader(timeout_s=5.0)
    try:
        here = DiskLocation(server.endpoint, store.disk_id, 5, len(value))
        out = bytearray(len(value))
        assert reader.read("big", [here], memoryview(out)) is None and out == value
        assert reader.num_reads == 1 and server.num_reads == 2
        gone = DiskLocation(server.endpoint, store.disk_id, 6, len(value))  # another version
        error = reader.read("big", [gone], memoryview(out))
        assert isinstance(error, TransferError) and isinstance(error.__cause__, ObjectNotFound)
        path = tmp_path / file_name("big", 5)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(data)
        assert isinstance(reader.read("big", [here], memoryview(out)), ChecksumMismatch)
    finally:
        reader.close()
        server.close()
        store.close()


@settings(max_examples=30, deadline=None)
@given(value=st.binary(min_size=1, max_size=3000), put_id=st.integers(1, (1 << 63) - 1))
def test_any_bytes_survive_a_restart(tmp_path_factory: pytest.TempPathFactory, value: bytes, put_id: int) -> None:
    directory = tmp_path_factory.mktemp("disk")
    store = DiskStore(directory, 4096)
    crc = store.write("ключ/🔑", put_id, memoryview(value))
    store.close()
    again = DiskStore(directory, 4096)
    out = bytearray(len(value))
    again.read_checked("ключ/🔑", put_id, memoryview(out))
    assert out == value and again.info("ключ/🔑", put_id) == (len(value), crc)
    again.close()
