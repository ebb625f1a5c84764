"""The processes `tsukimi up` starts (tsukimi/serving/cluster/up.py), as their supervisor: spawns
them in groups, waits for their health, restarts one that dies, and stops them all.

    start_group(specs) -> each child: `python -m tsukimi.cli ARGS` (another command: under
                          `python -m tsukimi.lifeline`), a session of its own,
                          LOG_DIR/NAME.log, its spec's nice value (the engines': a lower CPU
                          priority than the router's), and the read end of a lifeline
                          (tsukimi/lifeline.py): when this process dies, even by SIGKILL, the
                          children stop themselves
    tend()             -> a child that exited is started again after a backoff (`ClusterRestartConfig`:
                          initial_backoff_s, doubling up to max_backoff_s); more than
                          max_restarts within window_s is a crash loop: PeerError (the cluster
                          stops). max_restarts 0: any exit is a PeerError (the old behaviour)
    stop()             -> SIGTERM each group, last started first, SIGKILL after stop_timeout_s
    respawn(child)     -> that child stopped and started again at once (a test's restart)
    drop_group(group)  -> one group stopped and forgotten (a group that failed to start)

tsukimi/serving/cluster/launcher.py drives it for `tsukimi up` and every bench or test cluster.

A restarted child keeps its name, arguments and port, so the others find it where it was: the
router marks it up again at its next poll (tsukimi/serving/router/worker_client.py), a PD worker mounts
a new segment in the KV pool, and its KV event feed restarts (tsukimi/serving/router/index_feed.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tsukimi.clock import WallClock
from tsukimi.config import ClusterRestartConfig
from tsukimi.errors import PeerError
from tsukimi.lifeline import Lifeline
from tsukimi.serving.cluster.process_spec import ProcessSpec

logger = logging.getLogger(__name__)

_LIFELINE_STEP_S = 1.0  # between the groups' stops when this process died (master, workers, router)
_LIFELINE_GROUPS = 3
_HEALTH_POLL_S = 0.1


@dataclass(slots=True)
class Child:
    """One supervised process: its spec, the current process, its log, and when it was
    restarted (WallClock readings); `restart_at`: when it will be started again (None: alive
    or not due)."""

    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    log: Path
    restarts: list[float] = field(default_factory=list)
    restart_at: float | None = None


class Supervisor:
    """The processes `tsukimi up` started, in groups; `stop()` ends every one of them."""

    def __init__(
        self, log_dir: Path, stop_timeout_s: float, verbose: int = 1, restart: ClusterRestartConfig | None = None
    ) -> None:
        self.log_dir, self.stop_timeout_s, self.verbose = log_dir, stop_timeout_s, verbose
        self.restart = restart if restart is not None else ClusterRestartConfig(max_restarts=0)
        self.groups: list[list[Child]] = []
        self._clock = WallClock()
        self._lifeline: Lifeline | None = None

    @property
    def children(self) -> list[Child]:
        return [child for group in self.groups for child in group]

    def start_group(self, specs: Sequence[ProcessSpec]) -> None:
        """Spawn `python -m tsukimi.cli ARGS` for each spec (mutates). Raises OSError."""
        group: list[Child] = []
        self.groups.append(group)
        for spec in specs:  # NOTE: one by one: a spawn that fails leaves the ones before it to stop()
            group.append(Child(spec, *self._spawn(spec, "wb", len(self.groups) - 1)))

    def _spawn(self, spec: ProcessSpec, mode: str, group: int) -> tuple[subprocess.Popen[bytes], Path]:
        if self._lifeline is None:
            self._lifeline = Lifeline()
        log = self.log_dir / f"{spec.name}.log"
        verbosity = ["-" + "v" * self.verbose] if self.verbose else []
        # NOTE: a command not tsukimi's (etcd, vLLM) runs under the lifeline's wrapper
        wrapped = [sys.executable, "-m", "tsukimi.lifeline", *spec.argv] if spec.argv else []
        argv = wrapped or [sys.executable, "-m", "tsukimi.cli", *verbosity, *spec.args]
        # NOTE: should this process die, the groups started first stop last (as stop() orders them)
        delay_s = _LIFELINE_STEP_S * max(0, _LIFELINE_GROUPS - 1 - group)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self._lifeline.env(delay_s), **dict(spec.env)}
        with log.open(mode) as out:  # NOTE: the child keeps its own descriptor
            # NOTE: a session of its own: the terminal's Ctrl-C reaches the supervisor only,
            # which stops the children in order (router first, master last).
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=self._lifeline.pass_fds,
            )
        if spec.nice:
            # NOTE: at once, before the interpreter it starts can spawn a thread (Linux keeps a
            # nice value per thread; new threads inherit their creator's). Raising it is never
            # refused, and `preexec_fn` is unsafe beside this process's threads.
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + spec.nice))
        logger.info("started %s (pid %d): %s", spec.name, proc.pid, " ".join(spec.args))
        return proc, log

    def wait_ready(
        self, group: Sequence[Child], deadline_s: float, stop: threading.Event, on_ready: Callable[[Child], None]
    ) -> bool:
        """Poll each child's /health until it says "ok"; False when `stop` was set first.

        Raises:
            PeerError: a child exited, or the deadline (a `WallClock` reading) passed.
        """
        pending = list(group)
        with httpx.Client(timeout=httpx.Timeout(2.0)) as client:
            while pending:
                for child in list(pending):
                    self._check_alive(child)
                    if healthy(client, child.spec.url, child.spec.health):
                        pending.remove(child)
                        on_ready(child)
                if pending and self._clock.now() > deadline_s:
                    names = ", ".join(c.spec.name for c in pending)
                    raise PeerError(f"{names} did not become healthy in time; logs in {self.log_dir}")
                if pending and stop.wait(_HEALTH_POLL_S):
                    return False
        return True

    def check_alive(self) -> None:
        """Raises PeerError naming the first child that exited."""
        for child in self.children:
            self._check_alive(child)

    def tend(self) -> bool:
        """Restart the children that died, each after its backoff (mutates; call it often);
        whether it started one.

        Raises:
            PeerError: a child exited and the policy forbids restarting it (a crash loop).
        """
        now, policy, started = self._clock.now(), self.restart, False
        for child in self.children:
            if child.proc.poll() is None:
                continue
            if child.restart_at is None:
                child.restarts = [t for t in child.restarts if now - t < policy.window_s]
                if len(child.restarts) >= policy.max_restarts:
                    self._check_alive(child, f" ({len(child.restarts)} restarts in {policy.window_s:.0f} s)")
                child.restart_at = now + policy.backoff_s(len(child.restarts))
                logger.warning(
                    "%s (pid %d) exited with code %s; restarting it in %.1f s",
                    child.spec.name,
                    child.proc.pid,
                    child.proc.returncode,
                    child.restart_at - now,
                )
            elif now >= child.restart_at:
                index = next(i for i, group in enumerate(self.groups) if child in group)
                child.proc, child.log = self._spawn(child.spec, "ab", index)
                child.restarts.append(now)
                child.restart_at, started = None, True
        return started

    def _check_alive(self, child: Child, why: str = "") -> None:
        code = child.proc.poll()
        if code is not None:
            raise PeerError(
                f"{child.spec.name} exited with code {code}{why}; the end of {child.log}:\n{_tail(child.log)}"
            )

    def stop(self) -> None:
        """SIGTERM each group, last started first; SIGKILL what outlives stop_timeout_s. Idempotent."""
        for group in reversed(self.groups):
            self._stop_children(group)
        self.groups.clear()
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None

    def drop_group(self, group: Sequence[Child]) -> None:
        """Stop the children of `group` (as `stop` does) and forget the group (mutates)."""
        self._stop_children(group)
        self.groups = [g for g in self.groups if g is not group]

    def respawn(self, child: Child) -> None:
        """Stop `child` (SIGTERM, SIGKILL after stop_timeout_s) and start it again now, with
        the same spec, appending to its log (mutates `child`). Raises OSError."""
        self._stop_children([child])
        index = next(i for i, group in enumerate(self.groups) if child in group)
        child.proc, child.log = self._spawn(child.spec, "ab", index)
        child.restart_at = None

    def _stop_children(self, group: Sequence[Child]) -> None:
        for child in group:
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = self._clock.now() + self.stop_timeout_s
        for child in group:
            try:
                child.proc.wait(timeout=max(0.0, deadline - self._clock.now()))
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) ignored SIGTERM: killing it", child.spec.name, child.proc.pid)
                child.proc.kill()
                child.proc.wait(timeout=5)
            # NOTE: what the child left behind in its session (vLLM's engine core) goes too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)


def healthy(client: httpx.Client, url: str, kind: str = "tsukimi") -> bool:
    """Whether `url`/health answers as `kind` says a ready process does (see ProcessSpec)."""
    if kind == "none":
        return True
    try:
        response = client.get(url + "/health")
        if kind == "http":
            return response.status_code == 200
        return response.status_code == 200 and response.json().get("status") == "ok"
    except (httpx.HTTPError, ValueError):
        return False


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"
