"""THE cluster launcher: groups of processes (`ProcessSpec`s, as `tsukimi up`'s plan gives them)
started in order under the Supervisor, each group once the one before is healthy, and all of
them stopped on the way out, also when starting fails.

    groups = plan(config)                               (up.py; integrations/vllm/launch.py's
                                                         plan_vllm; a bench's or a test's own)
    with LaunchedCluster(groups, LaunchConfig(log_dir)) as cluster:
        cluster.api                                     the last group's first URL (the router)
        cluster.master                                  the store master's URL ("" without one)
        cluster.processes                               name, role, pid, url, log of each child
        cluster.start_group([spec])                     one more group (a retried router)
        cluster.drop_group()                            the newest group stopped (that router)
        cluster.kill("holder-0"); cluster.restart("master")
        with cluster.tending(): ...                     children that die restarted meanwhile

`tsukimi up` (up.py `supervise`) runs on it, and so do the benches (serve, overload, vllm,
kv-burst, cpp) and the test kit's store (tsukimi/testing/deployments.py `TsukimiCluster`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tsukimi.clock import WallClock
from tsukimi.config import ClusterRestartConfig
from tsukimi.errors import ConfigError, PeerError
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.cluster.supervisor import Child, Supervisor

OnChild = Callable[[Child], None]


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Where the children log, how long starting may take (all groups together) and stopping
    each group, their verbosity (`-v` count) and restart policy (None: a child that exits is
    an error, never restarted: what a benchmark or a test wants)."""

    log_dir: Path
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 10.0
    verbose: int = 0
    restart: ClusterRestartConfig | None = None


@dataclass(frozen=True, slots=True)
class LaunchedProcess:
    """One running child of a launched cluster."""

    name: str
    role: str
    pid: int
    url: str
    log: Path


class LaunchedCluster:
    """Processes started group by group under one Supervisor (see the module). A context
    manager: entering starts every group (raising, with everything stopped, when one fails),
    leaving stops them all. Not thread-safe."""

    def __init__(
        self, groups: Sequence[Sequence[ProcessSpec]], config: LaunchConfig, supervisor: Supervisor | None = None
    ) -> None:
        """`supervisor`: one made by the caller (`tsukimi up`'s), else one from `config`."""
        if not groups or not all(groups):
            raise ConfigError("a cluster needs at least one group, and no group may be empty")
        self._groups = [list(group) for group in groups]
        self.config = config
        self.supervisor = supervisor or Supervisor(
            config.log_dir, config.stop_timeout_s, verbose=config.verbose, restart=config.restart
        )
        self._clock = WallClock()

    def start(
        self, stop: threading.Event | None = None, on_started: OnChild | None = None, on_ready: OnChild | None = None
    ) -> bool:
        """Start every group in order, each once the one before is healthy; False when `stop`
        was set first (what started keeps running: `stop()` it). `on_started` / `on_ready` are
        called for each child as it is spawned / healthy.

        Raises:
            PeerError: a child exited or was not healthy within startup_timeout_s (everything
                started is stopped first). OSError: a child could not be spawned (likewise).
        """
        deadline_s = self._clock.now() + self.config.startup_timeout_s
        try:
            for group in self._groups:
                if not self._start(group, deadline_s, stop, on_started, on_ready):
                    return False
        except BaseException:
            self.stop()
            raise
        return True

    def start_group(self, specs: Sequence[ProcessSpec], stop: threading.Event | None = None) -> bool:
        """Start one more group once the cluster is up and wait for its health (within
        startup_timeout_s from now: a group added an hour later gets its full time); False when
        `stop` was set first. A group that fails is stopped and forgotten, so the caller may try
        again (another port) or give up.

        Raises:
            PeerError / OSError: as `start`, but only this group is stopped.
        """
        before = len(self.supervisor.groups)
        try:
            return self._start(list(specs), self._clock.now() + self.config.startup_timeout_s, stop, None, None)
        except BaseException:
            for group in self.supervisor.groups[before:]:
                self.supervisor.drop_group(group)
            raise

    def _start(
        self,
        specs: list[ProcessSpec],
        deadline_s: float,
        stop: threading.Event | None,
        on_started: OnChild | None,
        on_ready: OnChild | None,
    ) -> bool:
        """Spawn one group and wait until each child is healthy, until `deadline_s` (a WallClock reading)."""
        self.supervisor.start_group(specs)
        group = self.supervisor.groups[-1]
        for child in group:
            if on_started is not None:
                on_started(child)
        return self.supervisor.wait_ready(group, deadline_s, stop or threading.Event(), on_ready or (lambda _: None))

    def drop_group(self) -> None:
        """Stop the newest group and forget it (a bench's router between two runs; mutates)."""
        if self.supervisor.groups:
            self.supervisor.drop_group(self.supervisor.groups[-1])

    @property
    def processes(self) -> list[LaunchedProcess]:
        """Every child started, in start order."""
        return [
            LaunchedProcess(c.spec.name, c.spec.role, c.proc.pid, c.spec.url, c.log) for c in self.supervisor.children
        ]

    def process(self, name: str) -> LaunchedProcess:
        """The child called `name`.

        Raises:
            ConfigError: no child is called that.
        """
        found = next((p for p in self.processes if p.name == name), None)
        if found is None:
            raise ConfigError(f"no process {name!r} in the cluster ({', '.join(p.name for p in self.processes)})")
        return found

    @property
    def api(self) -> str:
        """The URL of the last group's first process (the router, in `tsukimi up`'s plan)."""
        groups = self.supervisor.groups
        return groups[-1][0].spec.url if groups else self._groups[-1][0].url

    @property
    def master(self) -> str:
        """The URL of the first process whose role is "master" ("" without one)."""
        return next((p.url for p in self.processes if p.role == "master"), "")

    @property
    def log_dir(self) -> Path:
        return self.supervisor.log_dir

    def state(self) -> dict[str, object]:
        """What `tsukimi up --state-file` holds: the API's URL, the log directory, every child."""
        processes = [
            {"name": p.name, "role": p.role, "pid": p.pid, "url": p.url, "log": str(p.log)} for p in self.processes
        ]
        return {"api": self.api, "log_dir": str(self.log_dir), "processes": processes}

    def tend(self) -> bool:
        """Restart the children that died, as the restart policy says (Supervisor.tend).

        Raises:
            PeerError: a child died and may not be restarted.
        """
        return self.supervisor.tend()

    def kill(self, name: str) -> None:
        """SIGKILL the child `name`, and whatever it started in its session (a command under
        the lifeline wrapper), and wait for it: a fault (`tending` may restart it).

        Raises:
            ConfigError: no such child.
        """
        child = self._child(name)
        with contextlib.suppress(ProcessLookupError):  # NOTE: each child leads a session of its own
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=5)

    def restart(self, name: str) -> None:
        """Stop the child `name` (SIGTERM) and start it again with the same arguments and port;
        returns once it is healthy.

        Raises:
            ConfigError: no such child. PeerError: it did not become healthy in time.
        """
        child = self._child(name)
        self.supervisor.respawn(child)
        deadline = self._clock.now() + self.config.startup_timeout_s
        self.supervisor.wait_ready([child], deadline, threading.Event(), lambda _: None)

    def _child(self, name: str) -> Child:
        child = next((c for c in self.supervisor.children if c.spec.name == name), None)
        if child is None:
            raise ConfigError(f"no process {name!r} in the cluster")
        return child

    @contextlib.contextmanager
    def tending(self, interval_s: float = 0.2) -> Iterator[None]:
        """While inside, a thread restarts the children that die, as `tsukimi up` does (the
        restart policy of the config); nothing else may touch the cluster meanwhile but to read
        it. A crash loop's PeerError is raised on the way out."""
        done, failures = threading.Event(), []

        def loop() -> None:
            while not done.wait(interval_s):
                try:
                    self.supervisor.tend()
                except PeerError as exc:
                    failures.append(exc)
                    return

        thread = threading.Thread(target=loop, name="cluster-tend", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
        if failures:
            raise failures[0]

    def stop(self) -> None:
        """Stop every child, last group first (SIGTERM, SIGKILL after stop_timeout_s). Idempotent."""
        self.supervisor.stop()

    def __enter__(self) -> LaunchedCluster:
        if not self.start():
            raise PeerError("interrupted while starting")  # NOTE: unreachable without a stop event
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def with_args(groups: Sequence[Sequence[ProcessSpec]], name: str, *extra: str) -> list[list[ProcessSpec]]:
    """`groups` with `extra` arguments appended to the process `name`'s (pure): a plan's child
    given settings its planner has no field for (a bench's router `--set`s).

    Raises:
        ConfigError: no process is called `name`.
    """
    from dataclasses import replace

    if not any(spec.name == name for group in groups for spec in group):
        raise ConfigError(f"no process {name!r} in the plan")
    return [[replace(s, args=(*s.args, *extra)) if s.name == name else s for s in group] for group in groups]
