"""Local processes and what driving them needs: a free loopback port, polling until a
condition holds, stopping children, and `JsonWorker`, the parent's handle on a `python -m ...`
child that speaks line-delimited JSON (with `child_reply`, the child's half).

The JSON-lines protocol: the parent writes one JSON command per line on the child's stdin and
reads one JSON reply per line; a reply is `{"ok": true, ...}` or `{"ok": false, "error": "..."}`.
Every read has a deadline; stderr goes to a temporary file whose tail is quoted in errors;
`stop()` closes stdin (the child's signal to exit), then kills, each wait bounded. The child
imports the tsukimi its parent imported: the caller's `pythonpath` entries first (tests pass
their checkout, so children run the code under test), then the parent's checkout, then
$PYTHONPATH, and PYTHONSAFEPATH=1: `python -m` would otherwise put the working directory ahead
of them all, and a bench run from one checkout with another on PYTHONPATH measured the working
directory's code in its children (docs/benchmarks.md, issue 27).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, cast

import httpx

from tsukimi.clock import WallClock
from tsukimi.errors import PeerError

logger = logging.getLogger(__name__)

Reply = dict[str, Any]  # one JSON reply line
_EXIT_TIMEOUT_S = 2.0
_KILL_TIMEOUT_S = 5.0
_STDERR_TAIL_BYTES = 2000
_GATHER_POLL_S = 0.02


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.02) -> None:
    """Poll `condition` every `interval_s` until it holds; an `httpx.HTTPError` it raises counts
    as "not yet" (a server still starting).

    Raises:
        PeerError: it did not hold within `timeout_s`.
    """
    clock = WallClock()
    deadline = clock.now() + timeout_s
    while True:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        if clock.now() > deadline:
            raise PeerError(f"condition not reached within {timeout_s} s")
        clock.sleep(interval_s)


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM them all, wait up to `timeout_s` each, SIGKILL the ones still running; closes
    their stdout pipes."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


class WorkerError(RuntimeError):
    """A worker process failed, hung or exited; the message quotes its stderr tail."""


_CHECKOUT = Path(__file__).resolve().parents[2]  # the directory holding this tsukimi package


class JsonWorker:
    """Parent-side handle on one `python -m ...` child speaking JSON lines.

    Args:
        label: a name for messages.
        module_args: what follows `python -m`.
        startup_timeout_s: how long to wait for the child's first (ready) reply.
        env: extra environment variables.
        pythonpath: entries put first on the child's PYTHONPATH (e.g. a checkout).
        wrapper: a command the child runs under, e.g. `ip netns exec NS` (an emulated host
            of tsukimi/lab: `lab.command(host, [])`); it must exec the child in its place.
    """

    def __init__(
        self,
        label: str,
        module_args: list[str],
        startup_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
        pythonpath: Sequence[str | Path] = (),
        wrapper: Sequence[str] = (),
    ) -> None:
        self.label = label
        self._clock = WallClock()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        full_env = {"PYTHONSAFEPATH": "1", **os.environ, **(env or {})}
        entries = [*map(str, pythonpath), str(_CHECKOUT), full_env.get("PYTHONPATH", "")]
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in entries if p)
        self._proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", *module_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=full_env,
            bufsize=0,
        )
        assert self._proc.stdout is not None and self._proc.stdin is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self._stdout_fd = self._proc.stdout.fileno()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._stdout_fd, selectors.EVENT_READ)
        self._pending = bytearray()
        try:
            self.ready = self.read_reply(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def call(self, timeout_s: float, **cmd: object) -> Reply:
        """Send one command and wait at most `timeout_s` for its reply. Raises WorkerError."""
        self.send(**cmd)
        return self.read_reply(timeout_s)

    def send(self, **cmd: object) -> None:
        """Send one command without waiting (`read_reply` later: several children can then
        work on their commands at once). Raises WorkerError when the child cannot be written."""
        try:
            self._stdin.write(json.dumps(cmd).encode() + b"\n")
            self._stdin.flush()
        except OSError as exc:
            raise WorkerError(self._describe(f"cannot send {cmd.get('cmd')!r}")) from exc

    def read_reply(self, timeout_s: float) -> Reply:
        """The next reply line. Raises WorkerError on timeout, exit or `"ok": false`."""
        reply = self.poll_reply(timeout_s)
        if reply is None:
            raise WorkerError(self._describe(f"no reply within {timeout_s:.1f} s"))
        return reply

    def poll_reply(self, timeout_s: float) -> Reply | None:
        """The next reply line if one arrives within `timeout_s`, else None. Raises
        WorkerError on exit or `"ok": false`."""
        deadline = self._clock.now() + timeout_s
        while b"\n" not in self._pending:
            remaining = deadline - self._clock.now()
            if remaining <= 0:
                return None
            if not self._selector.select(remaining):
                continue
            chunk = os.read(self._stdout_fd, 65536)
            if not chunk:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=_KILL_TIMEOUT_S)
                raise WorkerError(self._describe(f"exited (rc={self._proc.returncode})"))
            self._pending += chunk
        line, _, rest = bytes(self._pending).partition(b"\n")
        self._pending = bytearray(rest)
        reply = cast(Reply, json.loads(line))
        if not reply.get("ok"):
            raise WorkerError(self._describe(str(reply.get("error"))))
        return reply

    def _describe(self, what: str) -> str:
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - _STDERR_TAIL_BYTES))
        tail = self._stderr.read().decode(errors="replace").strip()
        return f"{self.label} (pid {self._proc.pid}): {what}\n--- stderr tail ---\n{tail}"

    def stop(self) -> None:
        """Close stdin (the child exits), then kill; every wait bounded. Idempotent."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self._proc.wait(timeout=_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            try:
                self._proc.wait(timeout=_KILL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("%s pid %d survived SIGKILL", self.label, self._proc.pid)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._stdout_fd)
        self._selector.close()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()

    def send_signal(self, signum: int) -> None:
        """Deliver a signal to the child (fault tests: SIGSTOP, SIGCONT, SIGKILL)."""
        self._proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the child now (fault tests), then clean up."""
        self._proc.kill()
        self.stop()


def gather(workers: Sequence[JsonWorker], timeout_s: float, **cmd: object) -> list[Reply]:
    """Send `cmd` to every worker, then collect their replies (in `workers`' order) as they
    come: the first worker that fails or exits raises at once, whoever else is still working.

    Raises:
        WorkerError: a worker failed or exited, or not all replied within `timeout_s`.
    """
    for worker in workers:
        worker.send(**cmd)
    clock = WallClock()
    deadline = clock.now() + timeout_s
    replies: dict[int, Reply] = {}
    while len(replies) < len(workers):
        if clock.now() > deadline:
            missing = ", ".join(w.label for i, w in enumerate(workers) if i not in replies)
            raise WorkerError(f"no reply to {cmd.get('cmd')!r} within {timeout_s:.1f} s from {missing}")
        for i, worker in enumerate(workers):
            if i not in replies and (reply := worker.poll_reply(_GATHER_POLL_S)) is not None:
                replies[i] = reply
    return [replies[i] for i in range(len(workers))]


def child_reply(obj: dict[str, Any], out: IO[str] | None = None) -> None:
    """Child side: write one reply line (adds "ok": true unless given)."""
    stream = out or sys.stdout
    stream.write(json.dumps({"ok": True, **obj}) + "\n")
    stream.flush()
