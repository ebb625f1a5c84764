"""The optional native loops (tsukimi/transfer/native.py, _native.c): the C key is the Python
key, byte for byte, on every kind of request the memo can meet; the copies and the peer check
do what their Python counterparts do; and without the extension the same-host fast path
still moves the bytes."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsukimi.transfer import native
from tsukimi.transfer.batch import OpCode, SegmentHandle, TransferRequest
from tsukimi.transfer.plan_memo import PlanMemo

needs_native = pytest.mark.skipif(native.NATIVE is None, reason=f"the native loops are not here: {native.WHY_NOT}")


def test_a_machine_with_a_c_compiler_has_the_native_loops() -> None:
    if shutil.which("cc") is None or os.environ.get("TSUKIMI_NATIVE") == "0":
        pytest.skip("no C compiler here (or TSUKIMI_NATIVE=0): the Python code runs instead")
    assert native.NATIVE is not None, native.WHY_NOT


def _released() -> memoryview:
    view = memoryview(bytearray(8))
    view.release()
    return view


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


# NOTE: every kind of buffer and field the key decides on, well-formed or not
LOCALS: list[Any] = [
    b"abcdefgh",
    b"",
    bytearray(16),
    bytearray(),
    memoryview(bytearray(32)),
    memoryview(bytearray(32))[::2],  # not contiguous
    memoryview(bytearray(32)).cast("I"),  # not bytes
    memoryview(b"readonly"),
    np.zeros(64, np.uint8),
    np.zeros((4, 8), np.float32),
    np.zeros(64, np.uint8)[::4],  # not contiguous
    np.zeros((8, 8), np.uint8).T,  # Fortran order
    np.zeros(0, np.uint8),
    np.zeros(3, np.int64)[1:],
    np.zeros((), np.float64),  # zero-dimensional
    _readonly(np.zeros(16, np.uint8)),
    (4096, 64),
    (4096, 0),
    (0, 64),
    (-1, 64),
    (4096, 64, 1),
    (4096, True),
    (4096.0, 64),
    (1 << 70, 64),  # an address no machine has: the key still keys it (planning refuses it)
    [1, 2, 3],  # not a host class
    "text",
    _released(),
]
OPS: list[Any] = [OpCode.READ, OpCode.WRITE, "read"]
SEGMENTS: list[Any] = [SegmentHandle(3, "peer-a", "auto"), SegmentHandle(9, "peer-b", "shm"), "peer-a", 7, None]
OFFSETS: list[Any] = [0, 4096, 1 << 40, -8, True, 1.5, None]
LENGTHS: list[Any] = [None, 0, 16, True, 2.0]


WELL_FORMED = [0, 2, 4, 6, 7, 8, 9, 13, 14, 15, 16, 23]  # indexes of LOCALS that key (for a write)


@st.composite
def requests(draw: st.DrawFn, well_formed: bool = False) -> TransferRequest:
    if well_formed:  # NOTE: lists that key, so that every field of a long key is compared
        return TransferRequest(
            OpCode.WRITE,
            draw(st.sampled_from(SEGMENTS[:3])),
            draw(st.integers(0, 1 << 48)),
            LOCALS[draw(st.sampled_from(WELL_FORMED))],
            draw(st.none() | st.integers(0, 64)),
            draw(st.integers(0, 64)),
        )
    return TransferRequest(
        draw(st.sampled_from(OPS)),
        draw(st.sampled_from(SEGMENTS)),
        draw(st.sampled_from(OFFSETS)),
        LOCALS[draw(st.integers(0, len(LOCALS) - 1))],  # NOTE: by index: sampled_from hashes its values
        draw(st.sampled_from(LENGTHS)),
        draw(st.sampled_from(OFFSETS)),
    )


def _python_key(listed: list[TransferRequest]) -> tuple[object, ...] | None:
    found = PlanMemo.python_key(listed)
    return None if found is None else found[0]


@needs_native
@settings(max_examples=600, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=5))
def test_the_native_key_is_the_python_key(listed: list[TransferRequest]) -> None:
    assert native.NATIVE is not None
    assert native.NATIVE.memo_key(listed) == _python_key(listed)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(requests(well_formed=True), min_size=1, max_size=8))
def test_the_native_key_of_lists_that_key_is_the_python_key(listed: list[TransferRequest]) -> None:
    assert native.NATIVE is not None
    key = native.NATIVE.memo_key(listed)
    assert key is not None and key == _python_key(listed) and len(key) == 10 * len(listed)


@needs_native
def test_the_native_key_of_well_formed_lists_keys_every_field() -> None:
    assert native.NATIVE is not None
    array = np.zeros(64, np.uint8)
    listed = [
        TransferRequest(OpCode.WRITE, SegmentHandle(1, "a", "shm"), 4096, array, 32, 8),
        TransferRequest(OpCode.READ, "b", 8192, (array.ctypes.data, 64)),
    ]
    key = native.NATIVE.memo_key(listed)
    assert key is not None and key == _python_key(listed)
    assert key[:10] == (False, 1, "a", "shm", 4096, 8, 32, array.ctypes.data, 64, False)
    assert key[10:17] == (True, key[11], "b", key[11], 8192, 0, None) and key[17:19] == (array.ctypes.data, 64)
    assert native.NATIVE.memo_key([]) == ()
    with pytest.raises(TypeError, match="sequence"):
        native.NATIVE.memo_key(5)


@needs_native
def test_copy_packed_moves_every_triple_and_refuses_a_partial_one() -> None:
    assert native.NATIVE is not None
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    target = np.zeros(1 << 16, np.uint8)
    src, dst = source.ctypes.data, target.ctypes.data
    copies = [(dst + 100, src, 4000), (dst + 9000, src + 5000, 1), (dst + 20000, src + 20000, 30000)]
    assert native.NATIVE.copy_packed(native.packed(copies)) is True
    expected = np.zeros_like(target)
    for to, at, size in copies:
        expected[to - dst : to - dst + size] = source[at - src : at - src + size]
    assert np.array_equal(target, expected)
    target[:] = np.arange(1 << 16) % 251
    before = target.copy()
    native.NATIVE.copy_packed(native.packed([(dst + 8, dst, 1000)]))  # overlapping: a memmove
    assert np.array_equal(target[8:1008], before[:1000])
    with pytest.raises(ValueError, match="triples"):
        native.NATIVE.copy_packed(native.packed([(dst, src, 8)])[:2])
    assert native.NATIVE.copy_packed(b"") is True


@pytest.fixture
def child_and_file() -> Iterator[tuple[subprocess.Popen[bytes], int, int, str]]:
    """A live child process with its pidfd, and an open, linked file."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    pidfd = os.pidfd_open(child.pid)
    handle, path = tempfile.mkstemp(prefix="tsukimi-native-")
    try:
        yield child, pidfd, handle, path
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        os.close(pidfd)
        os.close(handle)
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.parametrize("implementation", ["native", "python"])
def test_still_there_says_when_the_peer_exits_or_releases_a_file(
    child_and_file: tuple[subprocess.Popen[bytes], int, int, str],
    implementation: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if implementation == "native" and native.NATIVE is None:
        pytest.skip(native.WHY_NOT)
    if implementation == "python":
        monkeypatch.setattr(native, "NATIVE", None)
    child, pidfd, handle, path = child_and_file
    assert native.still_there(pidfd, (handle,)) and native.still_there(pidfd, ())
    assert not native.still_there(-1, ())  # a pidfd closed under the caller (PeerTable.close)
    spare = os.dup(handle)
    os.close(spare)
    assert not native.still_there(pidfd, (handle, spare))  # a closed descriptor
    os.unlink(path)
    assert not native.still_there(pidfd, (handle,))  # the owner released the file
    assert child.stdin is not None
    child.stdin.close()
    child.wait()
    assert not native.still_there(pidfd, ())


@needs_native
def test_still_there_refuses_more_files_than_it_checks() -> None:
    assert native.NATIVE is not None
    with pytest.raises(ValueError, match="at most 8"):
        native.NATIVE.still_there(0, tuple(range(9)))


FALLBACK = textwrap.dedent(
    """
    import numpy as np
    from tsukimi.config import Config, MetadataConfig, TransferConfig
    from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
    from tsukimi.transfer.native import NATIVE, WHY_NOT

    assert NATIVE is None and WHY_NOT == "TSUKIMI_NATIVE=0", WHY_NOT
    url = "memory://native-fallback"
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url))) as owner,
        TransferEngine("user", Config(TransferConfig(transport="shm"), MetadataConfig(url))) as user,
    ):
        buf = owner.allocate(1 << 20)
        data = np.random.default_rng(1).integers(0, 256, 4 * 65536, dtype=np.uint8)
        requests = [
            TransferRequest(OpCode.WRITE, "owner", buf.base + i * 65536, data[i * 65536 : (i + 1) * 65536])
            for i in range(4)
        ]
        for _ in range(4):  # planned, remembered, then the prepared call
            assert all(s.state is RequestState.COMPLETED for s in user.transfer(requests))
        entry = user._memo.get(user._memo.key(requests)[0])[0]
        assert entry is not None and entry.fast is not None
        assert bytes(buf.view[: 4 * 65536]) == data.tobytes()
    print("ok")
    """
)


def test_without_the_extension_the_python_code_moves_the_bytes() -> None:
    env = {**os.environ, "TSUKIMI_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_packed_holds_native_words() -> None:
    flat = native.packed([(1, 2, 3), (4, 5, 6)])
    assert flat.itemsize == ctypes.sizeof(ctypes.c_uint64) and list(flat) == [1, 2, 3, 4, 5, 6]


@needs_native
def test_cma_run_copies_each_group_and_checks_the_owner_first() -> None:
    """This process as the owner: its pidfd, its memory, a version word of its own."""
    assert native.NATIVE is not None
    cma_run = native.NATIVE.cma_run
    pidfd = os.pidfd_open(os.getpid())
    try:
        rng = np.random.default_rng(3)
        mine, theirs = rng.integers(0, 256, 1 << 16, dtype=np.uint8), np.zeros(1 << 16, np.uint8)
        here, there = mine.ctypes.data, theirs.ctypes.data
        word = np.array([7], np.uint64)
        version_at = word.ctypes.data
        write = (True, native.packed([(here, there, 1000), (here + 5000, there + 9000, 3000)]), 4000)
        assert cma_run(pidfd, os.getpid(), version_at, 7, (write,)) is True
        assert np.array_equal(theirs[:1000], mine[:1000]) and np.array_equal(theirs[9000:12000], mine[5000:8000])
        back = np.zeros(3000, np.uint8)
        read = (False, native.packed([(back.ctypes.data, there + 9000, 3000)]), 3000)
        assert cma_run(pidfd, os.getpid(), 0, 0, (read,)) is True and np.array_equal(back, mine[5000:8000])
        theirs[:] = 0
        assert cma_run(pidfd, os.getpid(), version_at, 8, (write,)) is False  # re-registered: nothing moved
        assert not theirs.any()
        assert cma_run(-1, os.getpid(), 0, 0, (write,)) is False  # the pidfd closed under the caller
        short = (True, native.packed([(here, there, 1000)]), 1001)  # moved less than asked
        assert cma_run(pidfd, os.getpid(), 0, 0, (short,)) is False
        assert cma_run(pidfd, os.getpid(), 0, 0, ()) is True
        with pytest.raises(ValueError, match="triples"):
            cma_run(pidfd, os.getpid(), 0, 0, ((True, b"12345678", 8),))
        with pytest.raises(TypeError):
            cma_run(pidfd, os.getpid(), 0, 0, ((True, "text", 8),))
        with pytest.raises(TypeError, match="tuple"):
            cma_run(pidfd, os.getpid(), 0, 0, ([True, b"", 0],))
    finally:
        os.close(pidfd)


def test_a_build_from_another_source_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place build left from an older _native.c (without a function the code now calls)
    falls back to Python instead of failing at the first call."""
    import types

    stale = types.ModuleType("tsukimi.transfer._native")
    stale.VERSION = native.VERSION - 1  # type: ignore[attr-defined]
    monkeypatch.setattr(native.importlib, "import_module", lambda name: stale)
    module, why = native._load()
    assert module is None and "another _native.c" in why
    monkeypatch.setenv("TSUKIMI_NATIVE", "0")
    assert native._load() == (None, "TSUKIMI_NATIVE=0")
