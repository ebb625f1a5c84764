"""Links with delay and jitter (the delay line, tsukimi/lab/delay_line.py: two TAPs and a
forwarder in the hub): jitter spreads the round trip without reordering or losing frames at low
rates, a veth link given delay at run time is rebuilt under its open connections, rate, loss,
partitions and link_down work on a delay link as on a veth one, and no forwarder outlives its
lab (closed, or its runner SIGKILLed)."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tsukimi.errors import ConfigError
from tsukimi.lab import HostSpec, Lab, LinkShape, Topology
from tsukimi.lab.delay_handle import DelayLine, Timing
from tsukimi.lab.netns import lab_namespaces, run_tool
from tsukimi.testing.processes import wait_until

from .conftest import needs_namespaces, popen_python, python_in
from .test_lab import SOURCE, _sink

pytestmark = needs_namespaces

ECHO = """
import socket, threading
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("{addr}", 7000))
t = socket.socket(); t.bind(("{addr}", 7001)); t.listen()
def udp():
    while True:
        data, peer = s.recvfrom(2048); s.sendto(data, peer)
threading.Thread(target=udp, daemon=True).start()
print("listening", flush=True)
c, _ = t.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := c.recv(64):
    c.sendall(data)
"""

PROBES = """
import json, socket, threading, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout({wait_s})
sent, got = {{}}, []
def receive():
    try:
        while True:
            data = s.recv(2048); got.append((int(data[:8]), time.monotonic()))
    except socket.timeout:
        pass
reader = threading.Thread(target=receive); reader.start()
for i in range({count}):
    sent[i] = time.monotonic(); s.sendto(b"%08d" % i + b"." * 200, ("{addr}", 7000)); time.sleep({gap_s})
reader.join()
print(json.dumps([[i, t - sent[i]] for i, t in got]))
"""


def _echo(lab: Lab, host: str) -> subprocess.Popen[bytes]:
    proc = popen_python(lab, host, ECHO.format(addr=lab.address(host)))
    assert proc.stdout is not None and proc.stdout.readline() == b"listening\n"
    return proc


def _probe(lab: Lab, count: int, gap_s: float = 0.002, wait_s: float = 1.0) -> list[tuple[int, float]]:
    """`count` UDP datagrams from a to b's echo, `gap_s` apart: (sequence, RTT s) of each
    answered, in the order the answers came."""
    code = PROBES.format(addr=lab.address("b"), count=count, gap_s=gap_s, wait_s=wait_s)
    return [(int(i), float(rtt)) for i, rtt in json.loads(python_in(lab, "a", code))]


def test_jitter_spreads_the_rtt_and_frames_keep_their_order_and_all_arrive() -> None:
    """a: 20 ms +- 10 ms each way; b: no delay. 400 datagrams at 500/s: every one answered,
    in the order sent, 90 % of RTTs within 2 x (20 +- 10) ms (+ scheduling slack), spread,
    and the median near 40 ms (the jitter wanders around the delay: tsukimi/lab/delay_line.py)."""
    jittery = LinkShape(delay_ms=20.0, jitter_ms=10.0)
    with Lab(Topology((HostSpec("a", (jittery,)), HostSpec("b", (LinkShape(),))))) as lab:
        echo = _echo(lab, "b")
        answers = _probe(lab, 400)
        echo.kill()
    order = [i for i, _ in answers]
    rtts_ms = sorted(rtt * 1000 for _, rtt in answers[1:])  # NOTE: the first also waited for ARP
    assert order == list(range(400)), f"{400 - len(order)} lost; reordered: {order != sorted(order)}"
    p90_ms = rtts_ms[len(rtts_ms) * 9 // 10]
    # NOTE: above 60 ms only by scheduling on 2 busy CPUs (the probe's and the forwarder's)
    assert rtts_ms[0] >= 20.0 and p90_ms <= 60.0 + 20.0 and rtts_ms[-1] <= 60.0 + 90.0, (
        rtts_ms[0],
        p90_ms,
        rtts_ms[-1],
    )
    assert 33.0 <= statistics.median(rtts_ms) <= 52.0, statistics.median(rtts_ms)
    assert rtts_ms[-20] - rtts_ms[20] >= 10.0, "jitter did not spread the round trips"
    low, median, high = rtts_ms[0], statistics.median(rtts_ms), rtts_ms[-1]
    print(f"\njitter 20+-10 ms: RTT min {low:.1f}, median {median:.1f}, p90 {p90_ms:.1f}, max {high:.1f} ms")


def _round_trip_s(conn: socket.socket) -> float:
    start = time.monotonic()
    conn.sendall(b"ping")
    assert conn.recv(64) == b"ping"
    return time.monotonic() - start


def test_a_veth_link_given_delay_is_rebuilt_under_its_open_connections() -> None:
    """set_link(delay=...) on a veth link makes it a delay line: the TCP connection opened
    before carries on (same MAC and address), with the delay in its round trip; retimed to 0
    ms it stays a (now undelaying) delay line."""
    with Lab(Topology.of("a", "b")) as lab:
        echo = _echo(lab, "b")
        mac = run_tool("ip", "-n", lab.namespace("a"), "-o", "link", "show", "eth0").split("link/ether")[1].split()[0]
        with lab.entered("a"):
            conn = socket.create_connection((lab.address("b"), 7001), timeout=10)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            before_s = min(_round_trip_s(conn) for _ in range(3))
            lab.set_link("a", 0, delay="30ms")
            assert f"link/ether {mac}" in run_tool("ip", "-n", lab.namespace("a"), "-o", "link", "show", "eth0")
            delayed_s = min(_round_trip_s(conn) for _ in range(3))
            lab.set_link("a", 0, delay="0ms")
            after_s = min(_round_trip_s(conn) for _ in range(3))
        finally:
            conn.close()
            echo.kill()
    assert before_s < 0.02 and after_s < 0.02, (before_s, after_s)
    assert 0.058 <= delayed_s <= 0.12, f"{delayed_s * 1000:.0f} ms over a 30 ms link"


def test_rate_loss_partitions_and_link_down_work_on_a_delay_link() -> None:
    """The tbf and the BPF drop filter sit on the TAP ends as on veth ends."""
    delayed = LinkShape(rate_bps=20_000_000, delay_ms=5.0)
    with Lab(Topology((HostSpec("a", (delayed,)), HostSpec("b", (LinkShape(delay_ms=5.0),))))) as lab:
        sink = _sink(lab, "b")
        python_in(lab, "a", SOURCE.format(addr=lab.address("b"), seconds=1.5))
        out, _ = sink.communicate(timeout=10)
        assert 0.5 * 20e6 <= float(out) <= 1.1 * 20e6, f"{float(out) / 1e6:.1f} Mbit/s on a 20 Mbit/s delay link"
        echo = _echo(lab, "b")

        def answered() -> int:
            return len(_probe(lab, 10, gap_s=0.005, wait_s=0.3))

        assert answered() == 10
        lab.set_link("a", 0, loss="100%")
        assert answered() == 0
        lab.set_link("a", 0, loss="0%")
        wait_until(lambda: answered() == 10, timeout_s=10)
        lab.partition("a", "b")
        assert answered() == 0
        lab.heal()
        wait_until(lambda: answered() == 10, timeout_s=10)
        lab.link_down("b")
        assert answered() == 0
        lab.link_up("b")
        wait_until(lambda: answered() == 10, timeout_s=10)
        echo.kill()


def _forwarders(hub: str) -> list[int]:
    """The pids of the delay lines running in `hub`."""
    pids = [int(p) for p in run_tool("ip", "netns", "pids", hub, check=False).split()]
    return [p for p in pids if b"tsukimi.lab.delay_line" in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_no_forwarder_outlives_a_closed_lab() -> None:
    lab = Lab(Topology((HostSpec("a", (LinkShape(delay_ms=5.0),) * 2), HostSpec("b", (LinkShape(),)))))
    pids = _forwarders(lab.hub)
    lab.close()
    assert len(pids) == 2
    assert not [p for p in pids if _running(p)]


def test_no_forwarder_outlives_a_runner_killed_mid_lab() -> None:
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, time\n"
            "from tsukimi.lab import HostSpec, Lab, LinkShape, Topology\n"
            "lab = Lab(Topology((HostSpec('a', (LinkShape(delay_ms=5.0),)), HostSpec('b', (LinkShape(),)))))\n"
            "print(json.dumps([lab.hub, lab.namespace('a'), lab.namespace('b')]), flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
    )
    assert runner.stdout is not None
    names = json.loads(runner.stdout.readline())
    pids = _forwarders(names[0])
    assert len(pids) == 1
    runner.kill()
    runner.wait()
    wait_until(lambda: not set(names) & set(lab_namespaces()) and not any(_running(p) for p in pids), timeout_s=10)


def test_a_delay_line_that_cannot_start_is_a_clear_config_error() -> None:
    with Lab(Topology.of("a")) as lab:
        with pytest.raises(ConfigError, match=r"delay line of .*/eth0 failed: error: cannot make TAP eth0"):
            DelayLine(lab.namespace("a"), "eth0", lab.hub, "spare", Timing(5.0, 0.0))  # NOTE: eth0 is a veth end
        with pytest.raises(ConfigError, match="no network namespace 'tsk-nowhere'"):
            DelayLine("tsk-nowhere", "eth9", lab.hub, "spare", Timing(5.0, 0.0))
        assert not _forwarders(lab.hub)
    with pytest.raises(ConfigError, match="jitter <= delay"):
        Timing(5.0, 6.0)
