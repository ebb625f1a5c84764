"""`DiskHolder`: a holder's side of the disk tier. It mounts the holder's disk directory
(`DiskStore`) with the master, registers the files it still holds (at start, and whenever
the master says it does not know the disk), serves them to readers (`DiskServer`), and runs
the disk tasks the master hands out, on one thread (`tsukimi-store-disk`):

    loop: DiskSync(results of the last tasks) -> tasks, in order:
          OffloadTask: this holder's memory replica -> a file (its crc32c reported)
          PromoteTask: a file -> a block (in this holder's segment: copied in place; elsewhere:
                       a Transfer Engine WRITE)
          DeleteTask:  delete the file

A task must end within half its timeout of its arrival (the master gives up on it at its
timeout): an offload that ends later deletes its file and reports a failure, a promotion is
not started later, so the master never records a copy made from memory it had already freed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tsukimi.clock import WallClock
from tsukimi.errors import OutOfBounds, TransferError, TsukimiError
from tsukimi.store import disk_protocol as dp
from tsukimi.store.disk import DiskStore
from tsukimi.store.disk_server import DiskServer
from tsukimi.store.master_link import MasterLink
from tsukimi.store.protocol import MAX_BATCH
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest

logger = logging.getLogger(__name__)

LocalView = Callable[[int, int], memoryview | None]
"""(address, size) -> a view of this holder's own registered memory there, or None."""
_TASK_SHARE = 0.5


class DiskHolder:
    """Runs until `close()`. `local_view` maps addresses of this holder's segment to memory."""

    def __init__(
        self,
        client_id: str,
        store: DiskStore,
        link: MasterLink,
        engine: TransferEngine,
        local_view: LocalView,
        *,
        host: str,
        poll_s: float,
        secret: bytes | None = None,
    ) -> None:
        """Mount and register the disk, then start serving it. Raises what the master raises
        (RpcTimeout, MasterUnavailable, ...) or ConfigError (the host cannot be bound)."""
        self.client_id = client_id
        self.store = store
        self._link = link
        self._engine = engine
        self._local_view = local_view
        self._poll_s = poll_s
        self._clock = WallClock()
        self._stop = threading.Event()
        self.server = DiskServer(store, host, secret)
        try:
            self._register()
        except BaseException:
            self.server.close()
            raise
        self._thread = threading.Thread(target=self._loop, name="tsukimi-store-disk", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        """Mount the disk and report every file; delete those the master refuses."""
        store = self.store
        self._link.call(dp.MountDisk(self.client_id, store.disk_id, self.server.endpoint, store.capacity_bytes))
        files = store.files()
        for start in range(0, max(1, len(files)), MAX_BATCH):
            chunk = files[start : start + MAX_BATCH]
            last = start + MAX_BATCH >= len(files)
            op = dp.RegisterDiskFiles(self.client_id, store.disk_id, chunk, last)
            result = self._link.call_as(op, dp.DiskFilesResult)
            for file, ok in zip(chunk, result.accepted, strict=True):
                if not ok:
                    store.delete(file.key, file.put_id)
        logger.info("disk %s registered with %d files", store.disk_id, len(files))

    def _loop(self) -> None:
        done: list[dp.TaskResult] = []
        busy = False
        while not self._stop.wait(0.0 if busy else self._poll_s):
            try:
                reply = self._link.call_as(dp.DiskSync(self.client_id, self.store.disk_id, done), dp.DiskSyncResult)
                done = []
                if not reply.known:
                    logger.warning("the master does not know disk %s: registering it again", self.store.disk_id)
                    self._register()
                    continue
            except TsukimiError as exc:
                logger.warning("disk sync with the master failed: %s", exc)
                busy = False
                continue
            arrived = self._clock.now()
            done = [self._run(task, arrived) for task in reply.tasks]
            busy = bool(done)

    def _run(self, task: dp.DiskTask, arrived: float) -> dp.TaskResult:
        start = time.perf_counter()
        try:
            if isinstance(task, dp.OffloadTask):
                crc = self._offload(task, arrived + _TASK_SHARE * task.timeout_s)
                return dp.TaskResult(task.task_id, True, checksum=crc, elapsed_s=time.perf_counter() - start)
            if isinstance(task, dp.PromoteTask):
                self._promote(task, arrived + _TASK_SHARE * task.timeout_s)
                return dp.TaskResult(task.task_id, True, elapsed_s=time.perf_counter() - start)
            self.store.delete(task.key, task.put_id)
            return dp.TaskResult(task.task_id, True)
        except (TsukimiError, OSError) as exc:
            logger.warning("disk task %s for %r failed: %s", type(task).__name__, task.key, exc)
            return dp.TaskResult(task.task_id, False, str(exc)[:1000])

    def _offload(self, task: dp.OffloadTask, deadline: float) -> int:
        view = self._local_view(task.address, task.size)
        if view is None:
            raise OutOfBounds(f"address {task.address:#x} (+{task.size}) is not in this holder's memory")
        crc = self.store.write(task.key, task.put_id, view)
        if self._clock.now() > deadline:
            self.store.delete(task.key, task.put_id)
            raise TransferError(f"offloading {task.key!r} took past its deadline")
        return crc

    def _promote(self, task: dp.PromoteTask, deadline: float) -> None:
        if self._clock.now() > deadline:
            raise TransferError(f"promoting {task.key!r}: the task arrived too late")
        local = self._local_view(task.address, task.size) if task.te_segment == self._engine.name else None
        if local is not None:
            self.store.read_checked(task.key, task.put_id, local)
            return
        data = bytearray(task.size)
        self.store.read_checked(task.key, task.put_id, memoryview(data))
        request = TransferRequest(OpCode.WRITE, task.te_segment, task.address, data)
        status = self._engine.transfer([request], timeout_s=max(0.05, deadline - self._clock.now()))[0]
        if status.state is not RequestState.COMPLETED:
            raise TransferError(f"promoting {task.key!r} to {task.te_segment}: {status.reason}")

    def close(self) -> None:
        """Stop running tasks, unmount the disk (best effort), stop serving reads and release
        the directory (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        try:
            self._link.call(dp.UnmountDisk(self.client_id, self.store.disk_id))
        except TsukimiError as exc:
            logger.info("unmounting disk %s: %s", self.store.disk_id, exc)
        self.server.close()
        self.store.close()
