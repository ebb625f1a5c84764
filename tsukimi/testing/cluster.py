"""A tsukimi store deployment in real processes on loopback: `tsukimi master` and holders
(`tsukimi holder`), each a `python -m tsukimi.cli` child; for tests, benchmarks and anything
else that wants a store it can SIGKILL parts of."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import httpx

from tsukimi.errors import PeerError
from tsukimi.testing.processes import free_port, stop_processes, wait_until

_STARTUP_S = 30.0


class TsukimiCluster:
    """A master and `num_holders` holders of `holder_bytes` each. `master_addr` is the RPC
    endpoint; `settings` are extra `--set` overrides for every process (e.g. force tcp)."""

    def __init__(self, holder_bytes: int, num_holders: int = 2, settings: tuple[str, ...] = ()) -> None:
        self.rpc_port, self.http_port = free_port(), free_port()
        self.master_addr = f"tcp://127.0.0.1:{self.rpc_port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.settings = settings
        self.procs: list[subprocess.Popen[bytes]] = []
        self.holder_names: list[str] = []
        try:
            self._start_master()
            for _ in range(num_holders):
                holder = self._spawn("holder", "--master", self.master_addr, "--segment-bytes", str(holder_bytes))
                self.holder_names.append(self._announced_name(holder))
            wait_until(lambda: len(httpx.get(self.http_url + "/segments", timeout=1).json()) == num_holders)
        except BaseException:
            self.close()
            raise

    def _start_master(self) -> None:
        self.master = self._spawn(
            "master", f"--set=master.rpc_port={self.rpc_port}", f"--set=master.http_port={self.http_port}"
        )
        wait_until(lambda: httpx.get(self.http_url + "/health", timeout=1).status_code == 200)

    def restart_master(self) -> None:
        """SIGTERM the master and start a new one on the same ports (its state is lost)."""
        self.master.terminate()
        self.master.wait(timeout=10)
        self.procs.remove(self.master)
        self._start_master()

    def kill_holder(self, index: int) -> None:
        """SIGKILL holder `index` (0-based, in start order)."""
        holder = [p for p in self.procs if p is not self.master][index]
        holder.kill()
        holder.wait(timeout=5)

    def _spawn(self, command: str, *args: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        cmd = [sys.executable, "-m", "tsukimi.cli", command, *args, *(f"--set={s}" for s in self.settings)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.procs.append(proc)
        return proc

    def _announced_name(self, proc: subprocess.Popen[bytes]) -> str:
        """A holder prints "holder NAME: ..." once its segment is mounted."""
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], _STARTUP_S)
        line = proc.stdout.readline().decode() if ready else ""
        if not line.startswith("holder "):
            raise PeerError(f"holder did not start (said {line!r})")
        return line.split()[1].rstrip(":")

    def wait_drained(self, timeout_s: float = 10.0) -> None:
        """Wait until no segment holds any block (removed objects' leases have ended)."""
        segments = self.http_url + "/segments"
        wait_until(lambda: not any(int(s["used"]) for s in httpx.get(segments, timeout=5).json()), timeout_s)

    def close(self) -> None:
        """Stop the holders (they unmount while the master still answers), then the master;
        SIGTERM, then SIGKILL; idempotent."""
        holders = [p for p in self.procs if p is not getattr(self, "master", None)]
        for group in (holders, [p for p in self.procs if p not in holders]):
            stop_processes(group)
        self.procs.clear()

    def __enter__(self) -> TsukimiCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
