"""`TaskRunner`: a store client carrying out the copy / move tasks the master hands it.

The master names a task's executor (the owner of its first target segment) and passes the
task with that client's next heartbeat (tsukimi/store/master/tasks.py). The runner, on a
thread of its own so that a long copy never delays a heartbeat, READs the object from its
first readable source replica into a staging buffer, WRITEs it to every target in one batch,
and reports the outcome with `FinishTask`; the master then adds the targets to the object's
replicas (and a move drops the source's).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from tsukimi.errors import TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.master_link import MasterLink
from tsukimi.store.replica_io import transfer_error
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest

logger = logging.getLogger(__name__)


class TaskRunner:
    """Runs assignments in arrival order on one daemon thread; `close()` stops it."""

    def __init__(self, engine: TransferEngine, link: MasterLink, client_id: str, timeout_s: float) -> None:
        """`timeout_s` bounds each READ and WRITE batch (the master's task deadline is its own)."""
        self._engine = engine
        self._link = link
        self._client_id = client_id
        self._timeout_s = timeout_s
        self._queue: queue.SimpleQueue[p.TaskAssignment | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="tsukimi-store-tasks", daemon=True)
        self._thread.start()

    def submit(self, tasks: Sequence[p.TaskAssignment]) -> None:
        """Queue tasks to run (returns at once)."""
        for task in tasks:
            self._queue.put(task)

    def close(self, join_s: float = 5.0) -> None:
        """Stop after the task at hand (the master fails the rest at their deadline)."""
        self._queue.put(None)
        self._thread.join(timeout=join_s)

    def _loop(self) -> None:
        while (task := self._queue.get()) is not None:
            error = self._copy(task)
            if error:
                logger.warning("task %d (%r) failed: %s", task.task_id, task.key, error)
            try:
                self._link.call(p.FinishTask(self._client_id, task.task_id, error))
            except TsukimiError as exc:  # NOTE: the master fails the task at its deadline
                logger.warning("could not report task %d to the master: %s", task.task_id, exc)

    def _copy(self, task: p.TaskAssignment) -> str:
        """READ the object, WRITE every target; "" on success, else why not."""
        staging = bytearray(task.size)
        reason = "the object has no replica to copy from"
        try:
            for source in task.sources:
                read = TransferRequest(OpCode.READ, source.te_segment, source.address, staging)
                status = self._engine.transfer([read], timeout_s=self._timeout_s)[0]
                if status.state is RequestState.COMPLETED:
                    break
                reason = str(transfer_error(status, f"reading {task.key!r} from {source.te_segment}"))
            else:
                return reason
            writes = [TransferRequest(OpCode.WRITE, t.te_segment, t.address, staging) for t in task.targets]
            for target, status in zip(
                task.targets, self._engine.transfer(writes, timeout_s=self._timeout_s), strict=True
            ):
                if status.state is not RequestState.COMPLETED:
                    return str(transfer_error(status, f"writing {task.key!r} to {target.te_segment}"))
        except TsukimiError as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""
