"""The lab on real namespaces: links between hosts, their shaping, each host's identity, and a
teardown that leaves nothing (closed, SIGKILLed, or reaped by the next lab)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tsukimi.errors import ConfigError
from tsukimi.lab import HostSpec, Lab, LinkShape, Topology
from tsukimi.lab.netns import lab_namespaces, run_tool
from tsukimi.testing.processes import wait_until

from .conftest import needs_namespaces, popen_python, python_in

pytestmark = needs_namespaces

SINK = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1] if len(sys.argv) > 1 else "{addr}", 5000)); s.listen()
print("listening", flush=True)
c, _ = s.accept(); total = 0; first = None
while chunk := c.recv(1 << 16):
    first = first or time.monotonic(); total += len(chunk)
print(total * 8 / (time.monotonic() - first), flush=True)
"""

SOURCE = """
import socket, time
s = socket.create_connection(("{addr}", 5000), timeout=5)
end = time.monotonic() + {seconds}; block = b"x" * (1 << 16)
while time.monotonic() < end:
    s.sendall(block)
s.close()
"""

LISTENER = """
import socket, time
s = socket.socket(); s.bind(("{addr}", 5000)); s.listen(64)
print("listening", flush=True)
time.sleep(60)
"""

CONNECT_RTT = """
import socket, time
best = 1e9
for _ in range(3):
    t = time.monotonic(); socket.create_connection(("{addr}", 5000), timeout=5).close()
    best = min(best, time.monotonic() - t)
print(best)
"""


def _sink(lab: Lab, host: str) -> subprocess.Popen[bytes]:
    proc = popen_python(lab, host, SINK.format(addr=lab.address(host)))
    assert proc.stdout is not None and proc.stdout.readline() == b"listening\n"
    return proc


def test_two_hosts_talk_and_the_root_namespace_sees_none_of_it() -> None:
    with Lab(Topology.of("a", "b")) as lab:
        sink = _sink(lab, "b")
        python_in(lab, "a", SOURCE.format(addr=lab.address("b"), seconds=0.2))
        out, _ = sink.communicate(timeout=10)
        assert float(out) > 0
        root = run_tool("ip", "-o", "addr", "show") + run_tool("ip", "-o", "link", "show")
        assert lab.address("a") not in root and lab.address("b") not in root
        assert "h0n0" not in root and "br0" not in root.split()
        assert set(lab_namespaces()) >= {
            lab.hub,
            lab.namespace("a"),
            lab.namespace("b"),
        }  # NOTE: a set: other labs may run


def test_a_shaped_link_carries_close_to_its_rate() -> None:
    with Lab(Topology.of("a", "b", link=LinkShape(rate_bps=100_000_000))) as lab:
        sink = _sink(lab, "b")
        python_in(lab, "a", SOURCE.format(addr=lab.address("b"), seconds=1.5))
        out, _ = sink.communicate(timeout=10)
        measured = float(out)
        assert 0.5 * 100e6 <= measured <= 1.1 * 100e6, f"{measured / 1e6:.1f} Mbit/s on a 100 Mbit/s link"


def test_delay_shows_in_the_connect_rtt() -> None:
    """25 ms each way on each host's link (a delay line each, tsukimi/lab/delay_line.py): a TCP
    connect's round trip crosses four delays, ~100 ms; retimed to 5 ms on a, ~60 ms."""
    delayed = LinkShape(delay_ms=25.0)
    with Lab(Topology((HostSpec("a", (delayed,)), HostSpec("b", (delayed,))))) as lab:
        listener = popen_python(lab, "b", LISTENER.format(addr=lab.address("b")))
        assert listener.stdout is not None and listener.stdout.readline() == b"listening\n"
        rtt_s = float(python_in(lab, "a", CONNECT_RTT.format(addr=lab.address("b"))))
        assert 0.098 <= rtt_s <= 0.16, f"connect RTT {rtt_s * 1000:.0f} ms over two 25 ms links (both ways)"
        lab.set_link("a", 0, delay="5ms")
        rtt_s = float(python_in(lab, "a", CONNECT_RTT.format(addr=lab.address("b"))))
        listener.kill()
        assert 0.058 <= rtt_s <= 0.12, f"connect RTT {rtt_s * 1000:.0f} ms over a 5 ms and a 25 ms link"


def test_each_host_reports_its_own_host_identity() -> None:
    code = "from tsukimi.transfer.segment import host_id; print(host_id())"
    with Lab(Topology.of("a", "b")) as lab:
        ids = {host: python_in(lab, host, code).strip() for host in ("a", "b")}
        assert ids == {"a": lab.host_id("a"), "b": lab.host_id("b")}
        assert ids["a"] != ids["b"]


def test_loss_drops_that_share_of_packets_and_link_down_cuts_the_host() -> None:
    probe = """
import socket
ok = 0
for _ in range(20):
    s = socket.socket(); s.settimeout(0.1)
    try: s.connect(("{addr}", 5999))
    except ConnectionRefusedError: ok += 1
    except OSError: pass
print(ok)
"""
    with Lab(Topology.of("a", "b")) as lab:

        def answered() -> int:
            return int(python_in(lab, "a", probe.format(addr=lab.address("b"))))

        lab.set_link("a", 0, loss="100%")
        assert answered() == 0
        lab.set_link("a", 0, loss="0%")
        wait_until(lambda: answered() == 20, timeout_s=10)  # NOTE: ARP was lost too: re-learnt
        lab.link_down("b")
        lab.link_down("b")  # NOTE: idempotent
        assert answered() == 0
        lab.link_up("b")
        wait_until(lambda: answered() == 20, timeout_s=10)  # NOTE: the neighbour entry is re-learnt


def test_close_leaves_no_namespace_link_or_process() -> None:
    lab = Lab(Topology.of("a", "b", nics=2))
    sleeper = lab.popen("a", [sys.executable, "-c", "import time; time.sleep(60)"])
    names = [lab.hub, lab.namespace("a"), lab.namespace("b")]
    assert "h1n1" in run_tool("ip", "-n", lab.hub, "link")
    lab.close()
    lab.close()  # NOTE: idempotent
    assert sleeper.poll() is not None
    assert not set(names) & set(lab_namespaces())
    assert run_tool("ip", "-n", lab.hub, "link", check=False) == ""
    assert lab.namespace("a") not in run_tool("ip", "netns", "list")


def test_a_runner_killed_mid_lab_leaves_nothing() -> None:
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, sys, time\n"
            "from tsukimi.lab import Lab, Topology\n"
            "lab = Lab(Topology.of('a', 'b'))\n"
            "lab.popen('a', [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(json.dumps([lab.hub, lab.namespace('a'), lab.namespace('b')]), flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
    )
    assert runner.stdout is not None
    names = json.loads(runner.stdout.readline())
    assert set(names) <= set(lab_namespaces())
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    wait_until(lambda: not set(names) & set(lab_namespaces()), timeout_s=10)


def test_a_new_lab_reaps_the_leftovers_of_a_dead_runner() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"tsk{dead.pid}x0-hub"
    run_tool("ip", "netns", "add", leftover)
    try:
        assert leftover in lab_namespaces()
        with Lab(Topology.of("a")):
            assert leftover not in lab_namespaces()
    finally:
        run_tool("ip", "netns", "delete", leftover, check=False)


def test_names_of_live_runners_are_left_alone() -> None:
    mine = f"tsk{os.getpid()}x999-hub"
    run_tool("ip", "netns", "add", mine)
    try:
        with Lab(Topology.of("a")):
            assert mine in lab_namespaces()
    finally:
        run_tool("ip", "netns", "delete", mine, check=False)


def test_unknown_hosts_and_nics_are_config_errors() -> None:
    start = time.monotonic()
    with Lab(Topology.of("a")) as lab:
        with pytest.raises(ConfigError, match=r"NICs 0\.\.0"):
            lab.address("a", 1)
        with pytest.raises(ConfigError, match="no host 'z'"):
            lab.popen("z", ["true"])
    assert time.monotonic() - start < 10
