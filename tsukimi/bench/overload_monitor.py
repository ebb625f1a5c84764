"""What `tsukimi bench serve --workload overload` watches while it loads the cluster: the API's
`/health` latency (and the router's health port's), every cluster process's resident memory,
and, once the load is over, each request's admission latency from the router's decision log.

`/health` is asked from a process of its own (so that neither the load generator's event loop
nor its GIL delays a probe), on a connection of its own (a sync httpx client), every
`interval_s`, each probe with a timeout (a timeout or an error is recorded as such). RSS is
read from /proc/<pid>/status (VmRSS; Linux) for each named pid every `interval_s`, in a thread.
NOTE: on a host with fewer cores than busy processes a probe still waits for a CPU: its
latency is what a client on that host sees, not the server's alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from tsukimi.bench.child import module_args


@dataclass(frozen=True, slots=True)
class Probe:
    at_s: float  # from the start of the probe thread
    latency_s: float
    ok: bool  # HTTP 200 within the timeout
    error: str = ""


class HealthProbe:
    """Probes `url`/health every `interval_s` from start() to stop(), from a process of its own
    (`python -m tsukimi.bench.child health-probe`, which writes one JSON line per probe to a file)."""

    def __init__(self, url: str, interval_s: float = 0.2, timeout_s: float = 2.0) -> None:
        self._args = (url, str(interval_s), str(timeout_s))
        self._timeout_s = timeout_s
        self._out = tempfile.NamedTemporaryFile(prefix="tsukimi-health-", suffix=".jsonl", delete=False)  # noqa: SIM115
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 30.0) -> None:
        """Start probing; returns once the first probe was made (or `ready_timeout_s` passed)."""
        cmd = [sys.executable, "-m", *module_args("health-probe", *self._args, self._out.name)]
        self._process = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + ready_timeout_s
        while os.path.getsize(self._out.name) == 0 and self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> list[Probe]:
        """Stop probing (closing its stdin; waits for the probe under way); the probes made, in order."""
        if self._process is not None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=self._timeout_s + 10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._out.close()
        try:
            with open(self._out.name, encoding="utf-8") as lines:
                return [Probe(*json.loads(line)) for line in lines if line.endswith("\n")]
        finally:
            os.unlink(self._out.name)


def _probe_loop(url: str, interval_s: float, timeout_s: float, out_path: str) -> None:
    """The probing process: one JSON line per probe until its stdin closes."""
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.buffer.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    origin = time.perf_counter()
    with (
        httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=1)) as client,
        open(out_path, "w", encoding="utf-8") as out,
    ):
        while not stop.is_set():
            begin = time.perf_counter()
            try:
                ok, error = client.get(f"{url}/health").status_code == 200, ""
            except httpx.HTTPError as exc:
                ok, error = False, f"{type(exc).__name__}: {exc}"
            end = time.perf_counter()
            out.write(json.dumps([begin - origin, end - begin, ok, error]) + "\n")
            out.flush()
            stop.wait(max(0.0, interval_s - (end - begin)))


def rss_bytes(pid: int) -> int | None:
    """The resident set size of process `pid` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@dataclass(slots=True)
class RssSampler:
    """Samples the RSS of each of `pids` (name -> pid) every `interval_s` from start() to stop();
    `cpu_mark()` notes each one's CPU seconds (to tell the CPU share of a phase)."""

    pids: Mapping[str, int]
    interval_s: float = 0.5
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # name -> [(at_s, bytes)]
    origin: float = field(default_factory=time.perf_counter)  # at_s counts from here
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """Take one sample of every process now (mutates `samples`)."""
        now = time.perf_counter() - self.origin
        for name, pid in self.pids.items():
            rss = rss_bytes(pid)
            if rss is not None:
                self.samples.setdefault(name, []).append((now, rss))

    def cpu_mark(self) -> dict[str, float]:
        """name -> CPU seconds used so far, for each process still running."""
        marks = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        return {name: s for name, s in marks.items() if s is not None}

    def stop(self) -> dict[str, list[tuple[float, int]]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()
        return self.samples

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


async def admission_latencies(url: str, request_ids: Sequence[str], batch: int = 100) -> list[float]:
    """Seconds from the router's door to the admission decision of each of `request_ids` whose
    decision record the router at `url` still holds with both times (`GET /decisions`, `batch`
    ids a call; tsukimi/serving/router/arrivals.py), in the order asked. A router that keeps no
    arrival times gives none. Raises httpx.HTTPError."""
    out: list[float] = []
    async with httpx.AsyncClient(timeout=30.0) as client:
        for at in range(0, len(request_ids), batch):
            answer = await client.get(f"{url}/decisions", params={"request_id": list(request_ids[at : at + batch])})
            answer.raise_for_status()
            for record in answer.json()["decisions"]:
                if record.get("arrived_s") is not None:
                    out.append(max(0.0, record["time_s"] - record["arrived_s"]))
    return out


def main(argv: list[str]) -> None:
    """The probing process of HealthProbe: URL INTERVAL_S TIMEOUT_S OUT_PATH."""
    _probe_loop(argv[0], float(argv[1]), float(argv[2]), argv[3])
