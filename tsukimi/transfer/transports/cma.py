"""Cross-memory attach (CMA) transport: same-host peers, any registered memory, one copy.

A segment's address space is its owner's virtual addresses, so a peer on this host can copy
straight between its own buffer and the owner's with `process_vm_readv` / `process_vm_writev`:
one system call moves a whole batch (the iovec lists of every slice), in one copy, whatever
the memory is (numpy arrays, torch tensors, an inference engine's KV cache, shared memory).
The owner's process does no work. A small batch is copied by the submitting thread; a large
one is cut into groups that worker threads copy in parallel (the call releases the GIL).

Permission: the kernel lets a process do this only where it may ptrace the owner (same uid,
and Yama's ptrace_scope 0, or CAP_SYS_PTRACE); containers with seccomp or Yama often refuse.
The first contact with a peer probes with a 1-byte read; a refusal is logged once and the
transport declines every peer from then on, so `auto` falls through to tcp.

Liveness: the peer is opened through a pidfd, and the process's start time is checked
against the one in its descriptor, so a recycled pid is never mistaken for the owner; the
pidfd is polled before and after every copy (a copy that raced the owner's death fails).

Device memory: the kernel cannot reach it, so cma refuses device buffers, the peer's
(`can_serve`) and local ones (`device_local = "refuse"`); `auto` then picks device_ipc, shm
or tcp.

Released ranges: nothing on the owner's side checks a CMA copy, so before each batch the
transport reads the owner's registration version (a uint64 whose address the descriptor
publishes). When it differs from the descriptor's, the descriptor is fetched again and a
slice whose range is no longer registered fails as out of bounds instead of landing in
memory the owner gave back. (As on every transport, an owner must not free memory that
transfers already in flight may still touch.)
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from collections.abc import Callable

from tsukimi.clock import Clock
from tsukimi.config import TransferConfig
from tsukimi.errors import ClosedError, OutOfBounds, PeerError, TsukimiError
from tsukimi.transfer.batch import OpCode, RequestRecord
from tsukimi.transfer.native import NATIVE, packed
from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor, view_address
from tsukimi.transfer.transports.base import PreparedItem, Slice, TransportContext, register_transport
from tsukimi.transfer.transports.same_host import (
    CopyWorkers,
    PeerProcess,
    PeerTable,
    live_slices,
    split_by_bytes,
    still_registered,
)
from tsukimi.transfer.transports.shares import Share, run_shares

logger = logging.getLogger(__name__)

INLINE_BYTES = 4 << 20  # a submit of at most this many bytes is copied by the submitting thread (one call)
GROUP_BYTES = 4 << 20  # larger submits: groups of about this size, one call each, on the workers
SLICE_BYTES = 64 << 20
IOV_MAX = 1024  # the kernel's limit of iovecs per call (UIO_MAXIOV)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_CALLS = {}
for _op, _name in ((OpCode.READ, "process_vm_readv"), (OpCode.WRITE, "process_vm_writev")):
    _call = getattr(_libc, _name)
    _call.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    _call.restype = ctypes.c_ssize_t
    _CALLS[_op] = _call
_READ = _CALLS[OpCode.READ]


class VersionWord:
    """A same-host peer's registration version, read straight from its memory (one
    process_vm_readv of the uint64 whose address its descriptor publishes; see the module).
    Also what the device_ipc transport checks before it copies."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # NOTE: built once: the owner's registration version is read before every batch
        self.word = ctypes.c_uint64()
        self.word_local = _IoVec(ctypes.addressof(self.word), 8)
        self.word_remote = _IoVec(0, 8)

    def read(self, peer: SegmentDescriptor) -> int | None:
        """The owner's registration version now (None when it publishes none, is gone, or
        the kernel refuses the read)."""
        if not peer.version_address:
            return None
        if self.word_remote.iov_base != peer.version_address:
            self.word_remote = _IoVec(peer.version_address, 8)
        if _READ(self.pid, ctypes.byref(self.word_local), 1, ctypes.byref(self.word_remote), 1, 0) != 8:
            return None
        return self.word.value


class _CmaPeer(PeerProcess):
    """A peer process, and whether a probe showed that the kernel lets us attach to it."""

    def __init__(self, desc: SegmentDescriptor) -> None:
        super().__init__(desc)
        self.probed = False
        self.version = VersionWord(desc.pid)


class CmaTransport:
    """Moves slices with process_vm_readv / process_vm_writev (see the module)."""

    name = "cma"
    slice_bytes = SLICE_BYTES
    device_local = "refuse"  # NOTE: process_vm_readv/writev reach host memory only

    def __init__(
        self, config: TransferConfig, local_host_id: str, clock: Clock, fetch: Callable[[str], SegmentDescriptor]
    ) -> None:
        self._host_id, self._clock, self._fetch = local_host_id, clock, fetch
        self._refused: str = ""  # why the kernel refused CMA (then every peer is declined)
        self._peers: PeerTable[_CmaPeer] = PeerTable("cma", _CmaPeer)
        self._num_workers = config.num_shm_workers
        self._workers: CopyWorkers[tuple[_CmaPeer, list[Slice]] | Share] = CopyWorkers(
            config.num_shm_workers, "tsukimi-cma", self._work, self._refuse
        )

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        if self._refused or buffer.device or peer.host_id != self._host_id:
            return False
        try:
            state = self._peers.get(peer)
        except OSError:  # another pid namespace, the process is gone, or its pid was reused
            return False
        return state.probed or self._probe(state, buffer)

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        state = self._peers.get(peer)
        slices = self._registered(state, peer, slices)
        total = sum(len(piece.local) for piece in slices)
        if total <= INLINE_BYTES:  # NOTE: the common small batch: no hand-off at all
            self._run(state, slices)
            return
        group: list[Slice] = []
        group_bytes = 0
        for piece in slices:
            group.append(piece)
            group_bytes += len(piece.local)
            if group_bytes >= GROUP_BYTES or len(group) == IOV_MAX:
                self._workers.put((state, group))
                group, group_bytes = [], 0
        if group:
            self._workers.put((state, group))

    def prepare(self, peer: SegmentDescriptor, items: list[PreparedItem]) -> Callable[[float], bool] | None:
        """Prepared requests (tsukimi/transfer/prepared.py): the iovec lists built once, cut in
        groups as `submit` cuts slices; each run checks the owner's registration version and
        liveness as `submit` does, then makes one call per group: all of them on the calling
        thread up to INLINE_BYTES (there, with tsukimi/transfer/native.py, checks and calls in
        one native call), above that shared with the workers, waited for at most the run's
        time left (shares.py)."""
        state = self._peers.get(peer)
        if NATIVE is not None and sum(len(local) for _, local, _ in items) <= INLINE_BYTES:
            return self._native_run(state, peer, items)  # NOTE: checks and calls in one native call
        calls: list[tuple[Callable[[], int], int]] = []
        for op in (OpCode.READ, OpCode.WRITE):
            pairs = [(view_address(local), offset, len(local)) for kind, local, offset in items if kind is op]
            group: list[tuple[int, int, int]] = []
            group_bytes = 0
            for pair in pairs:
                group.append(pair)
                group_bytes += pair[2]
                if group_bytes >= GROUP_BYTES or len(group) == IOV_MAX:
                    calls.append((raw_call(op, state.pid, group), group_bytes))
                    group, group_bytes = [], 0
            if group:
                calls.append((raw_call(op, state.pid, group), group_bytes))
        total = sum(size for _, size in calls)
        shares = [calls] if total <= INLINE_BYTES else split_by_bytes(calls, self._num_workers + 1, _call_bytes)
        works = [functools.partial(_all_moved, share) for share in shares]

        def run(timeout_s: float) -> bool:
            if self._refused or self._version(state, peer) not in (None, peer.version) or not state.alive():
                return False
            return run_shares(works, self._workers.put, timeout_s) and state.alive()

        return run

    def _native_run(
        self, state: _CmaPeer, peer: SegmentDescriptor, items: list[PreparedItem]
    ) -> Callable[[float], bool]:
        """`prepare`'s call for a batch the calling thread copies alone, as one native call
        (tsukimi/transfer/native.py `cma_run`): the same checks, in the same order."""
        assert NATIVE is not None
        groups = []
        for op in (OpCode.READ, OpCode.WRITE):
            triples = [(view_address(local), offset, len(local)) for kind, local, offset in items if kind is op]
            for start in range(0, len(triples), IOV_MAX):
                group = triples[start : start + IOV_MAX]
                groups.append((op is OpCode.WRITE, packed(group), sum(size for _, _, size in group)))
        call, address, version = NATIVE.cma_run, peer.version_address, peer.version
        frozen = tuple(groups)

        def run(timeout_s: float) -> bool:
            return not self._refused and bool(call(state.pidfd, state.pid, address, version, frozen))

        return run

    def close(self) -> None:
        self._workers.close()
        self._peers.close()

    # -- internals ---------------------------------------------------------------------

    def _work(self, item: tuple[_CmaPeer, list[Slice]] | Share) -> None:
        if isinstance(item, Share):
            item.run()
        else:
            self._run(*item)

    def _refuse(self, item: tuple[_CmaPeer, list[Slice]] | Share) -> None:
        if isinstance(item, Share):
            item.refuse()
        else:
            self._fail(item[1], ClosedError("cma transport is closed"))

    def _registered(self, state: _CmaPeer, peer: SegmentDescriptor, slices: list[Slice]) -> list[Slice]:
        """The slices whose ranges the owner still registers (see the module); the others end
        now (out of bounds, or a peer error while its registrations keep changing)."""
        version = self._version(state, peer)
        if version is None or version == peer.version:
            return slices
        return still_registered(peer, state.version.read, self._fetch, slices)[1]

    @staticmethod
    def _version(state: _CmaPeer, peer: SegmentDescriptor) -> int | None:
        """The owner's registration version now (None: none published, or the peer is gone;
        the copy itself then reports the dead peer)."""
        return state.version.read(peer)

    def _probe(self, state: _CmaPeer, buffer: BufferDescriptor) -> bool:
        """Read one byte of `buffer`: False (and CMA declined from now on) when the kernel
        refuses; a vanished range or peer is left to the request itself."""
        byte = ctypes.c_ubyte()
        local, remote = _IoVec(ctypes.addressof(byte), 1), _IoVec(buffer.base, 1)
        if _CALLS[OpCode.READ](state.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 1:
            state.probed = True
            return True
        err = ctypes.get_errno()
        if err == errno.EPERM:
            self._refused = f"process_vm_readv: {os.strerror(err)} (ptrace not permitted: Yama, seccomp or uid)"
            logger.warning("cma: the kernel refuses cross-memory attach (%s); using shm/tcp instead", self._refused)
            return False
        return err != errno.ENOSYS

    def _run(self, peer: _CmaPeer, slices: list[Slice]) -> None:
        """Copy the live slices of one peer with as few calls as possible; end each slice."""
        live = live_slices(slices, self._clock)
        for start in range(0, len(live), IOV_MAX):
            self._copy(peer, live[start : start + IOV_MAX])

    def _copy(self, peer: _CmaPeer, pieces: list[Slice]) -> None:
        """One call per op for `pieces`; a short or failed call is redone slice by slice to
        find the ones that fail."""
        if not peer.alive():
            self._fail(pieces, PeerError(f"owner process {peer.pid} of {peer.name} has exited"))
            return
        for op in (OpCode.READ, OpCode.WRITE):
            group = [piece for piece in pieces if piece.op is op]
            if not group:
                continue
            if self._call(peer, op, group) == sum(len(p.local) for p in group) and peer.alive():
                RequestRecord.slices_done([(piece.record, len(piece.local)) for piece in group])
            else:
                for piece in group:
                    self._one(peer, piece)

    def _one(self, peer: _CmaPeer, piece: Slice) -> None:
        moved = self._call(peer, piece.op, [piece])
        err = ctypes.get_errno() if moved < 0 else 0
        if moved == len(piece.local) and peer.alive():
            piece.record.slice_done(moved)
        elif err == errno.EFAULT or 0 <= moved < len(piece.local):
            where = f"[{piece.remote_offset:#x}, +{len(piece.local)})"
            self._fail([piece], OutOfBounds(f"{where} is not mapped in {peer.name}: released"))
        elif err == errno.ESRCH or not peer.alive():
            self._fail([piece], PeerError(f"owner process {peer.pid} of {peer.name} has exited"))
        else:
            self._fail([piece], PeerError(f"cma transfer to {peer.name} failed: {os.strerror(err)}"))

    @staticmethod
    def _call(peer: _CmaPeer, op: OpCode, pieces: list[Slice]) -> int:
        count = len(pieces)
        local, remote = (_IoVec * count)(), (_IoVec * count)()
        for i, piece in enumerate(pieces):
            size = len(piece.local)
            local[i].iov_base, local[i].iov_len = view_address(piece.local), size
            remote[i].iov_base, remote[i].iov_len = piece.remote_offset, size
        return int(_CALLS[op](peer.pid, local, count, remote, count, 0))

    @staticmethod
    def _fail(pieces: list[Slice], error: TsukimiError) -> None:
        for piece in pieces:
            piece.record.slice_failed(str(error), error.code)


def _all_moved(calls: list[tuple[Callable[[], int], int]]) -> bool:
    """Make each prepared call; whether every one moved all its bytes."""
    return all(call() == size for call, size in calls)


def _call_bytes(call: tuple[Callable[[], int], int]) -> int:
    return call[1]


def raw_call(op: OpCode, pid: int, pairs: list[tuple[int, int, int]]) -> Callable[[], int]:
    """One prepared process_vm_readv/writev over (local address, remote address, length)
    pairs, as a zero-argument call returning the bytes moved (-1 on error): the kernel's floor
    for this transport (`tsukimi bench transfer` measures it beside the transport)."""
    count = len(pairs)
    local, remote = (_IoVec * count)(), (_IoVec * count)()
    for i, (here, there, size) in enumerate(pairs):
        local[i].iov_base, local[i].iov_len = here, size
        remote[i].iov_base, remote[i].iov_len = there, size
    call = _CALLS[op]
    return lambda: int(call(pid, local, count, remote, count, 0))


def _create(context: TransportContext) -> CmaTransport:
    return CmaTransport(context.config, context.host_id, context.clock, context.fetch)


register_transport("cma", _create, rank=20)
