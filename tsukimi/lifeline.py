"""A child's lifeline to the process that started it: when the parent dies (even by SIGKILL),
the child shuts down cleanly instead of living on as an orphan.

    parent (tsukimi up)                          child (tsukimi worker, router, master, ...)
    Lifeline(): os.pipe(), keeps the write end   watch_from_env(): a daemon thread blocks in
    spawn(pass_fds=(read,), env=lifeline.env())    os.read(read_fd); EOF = every write end is
    ... parent dies: the kernel closes the         closed = the parent died -> SIGTERM to itself
        write end                                  (its usual clean shutdown, which stops its own
                                                   children); SIGKILL to its process group if
                                                   that has not ended it within `grace_s`

No `preexec_fn` (prctl(PR_SET_PDEATHSIG) needs one, and it is not safe in a process with
threads) and no polling: the pipe's read end is passed with `pass_fds` and named in the
environment variable LIFELINE_ENV ("FD,DELAY_S": a child others depend on, the store master,
waits DELAY_S before stopping, as an orderly stop would stop it last). The write end is not
inheritable (PEP 446), so only the parent holds it and grandchildren never keep it open.

A command that is not tsukimi's (etcd, vLLM) runs under `python -m tsukimi.lifeline CMD ARGS`:
it watches the lifeline, passes SIGTERM / SIGINT on to CMD and exits with CMD's status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

LIFELINE_ENV = "TSUKIMI_LIFELINE_FD"
DEFAULT_GRACE_S = 15.0


class Lifeline:
    """The parent's end: a pipe whose read end its children watch. Close it (or die) to tell
    them to stop. Not thread-safe; `close` is idempotent."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()

    def env(self, delay_s: float = 0.0) -> dict[str, str]:
        """The environment variable that tells a child which descriptor to watch, and how long
        to wait after EOF before stopping (so that those others depend on stop last)."""
        return {LIFELINE_ENV: f"{self.read_fd},{delay_s}"}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        """What `subprocess.Popen(pass_fds=...)` must keep open in the child."""
        return (self.read_fd,)

    def close(self) -> None:
        """Close both ends: every child watching sees EOF and shuts down (mutates)."""
        for fd in (self.read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.read_fd = self._write_fd = -1


def watch_from_env(grace_s: float = DEFAULT_GRACE_S) -> threading.Thread | None:
    """In a child: watch the descriptor LIFELINE_ENV names, if any (and forget the variable, so
    that this process's own children do not inherit a descriptor they were not given).

    Returns:
        the watcher's daemon thread, or None when the variable is unset or malformed.
    """
    value = os.environ.pop(LIFELINE_ENV, None)
    if value is None:
        return None
    fd_text, _, delay_text = value.partition(",")
    try:
        fd, delay_s = int(fd_text), float(delay_text or 0)
        os.fstat(fd)
    except (ValueError, OSError):
        logger.warning("%s=%r names no open descriptor: no lifeline", LIFELINE_ENV, value)
        return None
    thread = threading.Thread(target=_watch, args=(fd, delay_s, grace_s), name="lifeline", daemon=True)
    thread.start()
    return thread


def _watch(fd: int, delay_s: float, grace_s: float) -> None:
    """Block until the parent is gone, then stop this process after `delay_s` (see the module)."""
    try:
        while os.read(fd, 64):  # NOTE: nobody writes; data would be ignored
            pass
    except OSError as exc:
        logger.warning("lifeline read failed (%r): treating the parent as gone", exc)
    logger.warning("the parent process died: shutting down in %.1f s (pid %d)", delay_s, os.getpid())
    threading.Event().wait(delay_s)
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(grace_s)  # NOTE: a daemon thread: a clean exit ends it before this returns
    logger.error("still running %.0f s after the parent died: killing it", grace_s)
    if os.getpgrp() == os.getpid():  # NOTE: only a group of our own (`tsukimi up` starts sessions)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def run_command(argv: list[str]) -> int:
    """Run `argv` under this process's lifeline (see the module); its exit status (128 + the
    signal's number when a signal ended it). Raises OSError when it cannot be started."""
    watch_from_env()
    child = subprocess.Popen(argv)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(run_command(sys.argv[1:]))
