"""The shared-memory files behind `TransferEngine.allocate`."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tsukimi.errors import InvalidBufferError, OutOfSpace
from tsukimi.transfer.shared_memory import PAGE_BYTES, SharedMemoryAllocator, map_shared


def test_files_are_allocated_in_full_and_peers_see_the_same_bytes(tmp_path: Path) -> None:
    allocator = SharedMemoryAllocator(str(tmp_path))
    try:
        mapping = allocator.create(3 * PAGE_BYTES + 1)
        assert len(mapping.view) == 3 * PAGE_BYTES + 1
        stat = os.stat(tmp_path / mapping.name)
        assert stat.st_size == 4 * PAGE_BYTES
        assert stat.st_blocks * 512 >= stat.st_size  # no holes: a full disk fails here, not later
        mapping.view[:5] = b"hello"
        peer = map_shared(str(tmp_path), mapping.name)
        try:
            assert bytes(peer.view[:5]) == b"hello"
            peer.view[5:6] = b"!"
            assert bytes(mapping.view[:6]) == b"hello!"
        finally:
            peer.close()
        allocator.release(mapping.name)
        assert not (tmp_path / mapping.name).exists()
    finally:
        allocator.close()


def test_no_room_is_out_of_space_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    allocator = SharedMemoryAllocator(str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OutOfSpace, match="no room"):
        allocator.create(1 << 20)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InvalidBufferError):
        allocator.create(0)
    allocator.close()


def test_peers_map_only_tsukimi_files(tmp_path: Path) -> None:
    (tmp_path / "passwd").write_bytes(b"x" * PAGE_BYTES)
    for name in ("passwd", "../passwd", "tsukimi-1-zz"):
        with pytest.raises(InvalidBufferError):
            map_shared(str(tmp_path), name)
