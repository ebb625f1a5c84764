"""A harness for tests with real processes: `tsukimi master`, `tsukimi holder` and workload
clients (tests/store/workload.py) as subprocesses that a test can SIGKILL, SIGSTOP and SIGCONT.

Every process writes stdout and stderr to its own log file under the test's tmp_path; ready
lines are parsed from there with a bounded wait (a timeout or an early exit raises with the
log's tail). `ProcessGroup.close()` (or leaving `process_group(...)`) reaps everything it
started, stopped processes included, and removes the shared-memory files that SIGKILLed
processes could not (it reports any that a process which exited normally left behind).

    with process_group(tmp_path) as group:
        master = group.spawn_master(["master.client_ttl_s=1.0"])
        holder = group.spawn_holder(master.rpc_url, 64 << 20)
        holder.proc.kill()
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")
READY_TIMEOUT_S = 30.0
MASTER_READY = re.compile(r"master: RPC (?P<rpc>tcp://\S+), HTTP (?P<http>http://\S+)")
HOLDER_READY = re.compile(r"holder (?P<name>\S+): \d+ bytes mounted")
HANG_READY = re.compile(r"started (?P<replicas>\[.*\])")
WORKLOAD_READY = re.compile(r"workload ready")


Record = dict[str, Any]  # one JSON object: a workload line, a segment, a key's info


class ProcessError(AssertionError):
    """A process did not become ready, or exited when it should not have."""


@dataclass
class Proc:
    """One subprocess, its output in `log_path`. Signal methods do not raise for a process
    that has already exited."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    stopped: bool = False
    signals: list[str] = field(default_factory=list)  # what was sent, for the reaper and logs

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-num_lines:])

    def wait_line(self, pattern: re.Pattern[str], timeout_s: float = READY_TIMEOUT_S) -> re.Match[str]:
        """The first match of `pattern` in this process's output, waiting up to `timeout_s`.

        Raises:
            ProcessError: no match in time, or the process exited first (with the log tail).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            found = pattern.search(self.log())
            if found is not None:
                return found
            if not self.alive():
                raise ProcessError(
                    f"{self.name} (pid {self.pid}) exited with {self.popen.returncode} before "
                    f"printing {pattern.pattern!r}; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ProcessError(
                    f"{self.name} (pid {self.pid}) printed no {pattern.pattern!r} within "
                    f"{timeout_s} s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _signal(self, signum: signal.Signals) -> None:
        if self.alive():
            self.signals.append(signum.name)
            os.kill(self.pid, signum)

    def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL and wait until it is gone (a stopped process dies too)."""
        self._signal(signal.SIGKILL)
        self.popen.wait(timeout=timeout_s)
        self.stopped = False

    def stop(self) -> None:
        """SIGSTOP: the process freezes, its sockets stay open (a network partition)."""
        self._signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        """SIGCONT a stopped process."""
        self._signal(signal.SIGCONT)
        self.stopped = False

    def terminate(self, timeout_s: float = 5.0) -> int:
        """SIGTERM (after SIGCONT if stopped), then SIGKILL if it is still running after
        `timeout_s`. Returns the exit status (negative: the signal that ended it)."""
        if self.stopped:
            self.cont()
        self._signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.returncode


@dataclass(frozen=True)
class Master:
    proc: Proc
    rpc_url: str  # tcp://127.0.0.1:PORT
    http_url: str  # http://127.0.0.1:PORT

    def segments(self) -> list[Record]:
        """The master's /segments: segment_id, te_segment, client_id, capacity, used, healthy."""
        return httpx.get(self.http_url + "/segments", timeout=5).json()  # type: ignore[no-any-return]

    def query_key(self, key: str) -> Record | None:
        """The master's /query_key (None on 404): size, complete, replicas [{te_segment, address, size}]."""
        response = httpx.get(self.http_url + "/query_key", params={"key": key}, timeout=5)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Holder:
    proc: Proc
    name: str  # its Transfer Engine segment name (p2p: host:port of its TE server)


class ProcessGroup:
    """Processes started for one test; `close()` reaps them all (idempotent)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "250", **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        self.leaked_shm: list[str] = []  # files left by processes that exited normally

    def spawn(self, name: str, argv: Sequence[str]) -> Proc:
        """Start `argv` (stdout and stderr to `<log_dir>/<name>.log`, cwd the repository)."""
        log_path = self.log_dir / f"{name}.log"
        suffix = 1
        while log_path.exists():  # a restarted process keeps its old log
            suffix += 1
            log_path = self.log_dir / f"{name}.{suffix}.log"
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=REPO_ROOT,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def spawn_tsukimi(self, name: str, *args: str) -> Proc:
        return self.spawn(name, [sys.executable, "-m", "tsukimi.cli", *args])

    def spawn_master(
        self, settings: Sequence[str] = (), name: str = "master", timeout_s: float = READY_TIMEOUT_S
    ) -> Master:
        """`tsukimi master` on ephemeral ports (unless `settings` name them), with extra
        `--set` overrides (e.g. "master.client_ttl_s=1.0", "master.ha_etcd=etcd://..."); waits
        for its ready line. Raises ProcessError."""
        sets = ["master.rpc_port=0", "master.http_port=0", *settings]
        proc = self.spawn_tsukimi(name, "master", *(f"--set={s}" for s in sets))
        found = proc.wait_line(MASTER_READY, timeout_s)
        return Master(proc, found["rpc"].rstrip(","), found["http"])

    def start_holder(
        self, master_url: str, segment_bytes: int, settings: Sequence[str] = (), name: str = "holder"
    ) -> Proc:
        """Start `tsukimi holder` without waiting for it (see `ready_holder`)."""
        args = ["holder", "--master", master_url, "--segment-bytes", str(segment_bytes)]
        return self.spawn_tsukimi(name, *args, *(f"--set={s}" for s in settings))

    @staticmethod
    def ready_holder(proc: Proc, timeout_s: float = READY_TIMEOUT_S) -> Holder:
        """Wait for a holder's "holder NAME: ..." line (printed once its segment is mounted)."""
        return Holder(proc, proc.wait_line(HOLDER_READY, timeout_s)["name"])

    def spawn_holder(
        self, master_url: str, segment_bytes: int, settings: Sequence[str] = (), name: str = "holder"
    ) -> Holder:
        """`tsukimi holder` contributing `segment_bytes`; waits until it mounted. Raises ProcessError."""
        return self.ready_holder(self.start_holder(master_url, segment_bytes, settings, name))

    def spawn_holders(
        self, master_url: str, segment_bytes: int, count: int, settings: Sequence[str] = ()
    ) -> list[Holder]:
        """`count` holders started at once, then waited for (in start order)."""
        procs = [self.start_holder(master_url, segment_bytes, settings, f"holder{i}") for i in range(count)]
        return [self.ready_holder(proc) for proc in procs]

    def spawn_workload(
        self,
        master_url: str,
        out: Path,
        seconds: float,
        seed: int,
        *,
        keys: int = 32,
        value_bytes: int = 65536,
        replicas: int = 1,
        settings: Sequence[str] = (),
        name: str = "",
    ) -> Proc:
        """`python -m tests.store.workload` appending acknowledged operations to `out`; waits
        until it connected. Raises ProcessError."""
        argv = [
            sys.executable,
            "-m",
            "tests.store.workload",
            "--master",
            master_url,
            "--out",
            str(out),
            "--seconds",
            str(seconds),
            "--seed",
            str(seed),
            "--keys",
            str(keys),
            "--value-bytes",
            str(value_bytes),
            "--replicas",
            str(replicas),
        ]
        argv += [f"--set={s}" for s in settings]
        proc = self.spawn(name or f"workload{seed}", argv)
        proc.wait_line(WORKLOAD_READY)
        return proc

    def spawn_put_hang(
        self, master_url: str, key: str, nbytes: int, replicas: int = 1, settings: Sequence[str] = ()
    ) -> tuple[Proc, list[Record]]:
        """A client that heartbeats, sends a raw PutStart for `key` and hangs before PutEnd.
        Returns it and the replicas the master placed. Raises ProcessError."""
        argv = [
            sys.executable,
            "-m",
            "tests.store.workload",
            "put-start-and-hang",
            "--master",
            master_url,
            "--key",
            key,
            "--bytes",
            str(nbytes),
            "--replicas",
            str(replicas),
        ]
        argv += [f"--set={s}" for s in settings]
        proc = self.spawn(f"hang-{key}", argv)
        return proc, json.loads(proc.wait_line(HANG_READY)["replicas"])

    def close(self) -> None:
        """Reap every process: clients and holders first (SIGTERM, so they unmount while the
        masters still answer), then masters; SIGKILL whatever outlives its grace; stopped ones
        are SIGCONTed first. Then remove the shm files of these pids and check none remain."""
        masters = [p for p in self.procs if p.name.startswith("master")]
        for group in ([p for p in self.procs if p not in masters], masters):
            for proc in group:
                if proc.stopped:
                    proc.cont()
                if proc.alive():
                    proc._signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for proc in self.procs:
            left = shm_files_of(proc.pid)
            if left and proc.popen.returncode == 0:
                self.leaked_shm.extend(f"{proc.name}: {path.name}" for path in left)
            for path in left:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        remaining = [path.name for proc in self.procs for path in shm_files_of(proc.pid)]
        self.procs.clear()
        if remaining:
            raise ProcessError(f"shared-memory files left in {SHM_DIR}: {remaining}")


def shm_files_of(pid: int) -> list[Path]:
    """The tsukimi shared-memory files that process `pid` created."""
    return sorted(SHM_DIR.glob(f"tsukimi-{pid}-*"))


@contextlib.contextmanager
def process_group(log_dir: Path, env: dict[str, str] | None = None) -> Iterator[ProcessGroup]:
    """A `ProcessGroup` that is always closed (every process reaped, /dev/shm cleaned)."""
    group = ProcessGroup(log_dir, env)
    try:
        yield group
    finally:
        group.close()


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.01) -> float:
    """Poll until `condition()` holds; returns the seconds it took.

    Raises:
        AssertionError: it did not hold within `timeout_s` (naming `what`).
    """
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - start


# -- reading a workload's record -------------------------------------------------------


@dataclass(frozen=True)
class KeyState:
    """What a key may hold after a workload: `version` (None: removed or never put) as last
    acknowledged, and `maybe`: versions that a later ambiguous failure (a put or remove whose
    reply was lost) may have left instead (None for a remove)."""

    version: int | None
    maybe: frozenset[int | None] = frozenset()

    def allows(self, version: int | None) -> bool:
        return version == self.version or version in self.maybe


def read_records(path: Path) -> list[Record]:
    """Every JSON line of a workload's record (a torn last line is ignored)."""
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def key_states(path: Path) -> dict[str, KeyState]:
    """Every key a workload touched and what it may hold now (see KeyState)."""
    states: dict[str, KeyState] = {}
    for rec in read_records(path):
        key = rec.get("key")
        if not isinstance(key, str) or rec["op"] == "get":
            continue
        old = states.get(key, KeyState(None))
        if rec.get("ok"):
            states[key] = KeyState(rec["version"] if rec["op"] == "put" else None)
        elif rec.get("ambiguous"):  # a failed put or remove that may still have been applied
            states[key] = KeyState(old.version, old.maybe | {rec.get("version")})
    return states


def acknowledged(path: Path) -> dict[str, int]:
    """Keys (with versions) whose put was acknowledged and not removed after (whatever
    failed operations came later: see `key_states` for those)."""
    return {key: s.version for key, s in key_states(path).items() if s.version is not None}
