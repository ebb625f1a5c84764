"""The delay line: how a lab link gets delay and jitter without the kernel's netem (which this
machine's and CI's kernels lack). Such a link is two TAP devices with this process between them,
holding every frame for the link's delay (+- jitter) before passing it on, each way.

    host namespace             hub namespace
    eth0 (TAP) <-fd-> [ python -m tsukimi.lab.delay_line ] <-fd-> hNnK (TAP, on brK)
       tbf + BPF drop filter on each TAP's egress, exactly as on a veth pair's ends

    python -m tsukimi.lab.delay_line HOST_NS HOST_DEV HUB_NS HUB_DEV DELAY_MS JITTER_MS

The process creates each TAP in its namespace (TUNSETIFF; the descriptor stays valid whatever
namespace the process is in after), then stays in the hub namespace, so that deleting the lab
(`ip netns pids` + SIGKILL, also the janitor's) kills it; when it dies the TAPs vanish with
their descriptors. It prints "ready" (or "error: ...") once both exist. Its stdin is the
control pipe and its lifeline: a line "DELAY_MS JITTER_MS" retimes the link (frames already
queued keep their release time; it answers "ok"), and EOF (the lab closed the link, or the
runner died, even by SIGKILL: the kernel closes the only write end) ends it.

Jitter: each direction's extra delay wanders over time, at JITTER_SLOPE (ms per ms), toward a
target drawn uniformly in +-jitter, then toward the next: each frame gets the delay plus the
value at its arrival. Its mean is the delay whatever the traffic, and with a slope below 1 a
later frame never leaves before an earlier one: jitter spreads latency but never reorders.
(netem draws per packet and reorders unless rate-limited; reordering makes TCP retransmit,
which a latency experiment does not want. A per-frame draw with order kept would instead push
every frame of dense traffic toward delay + jitter.) Frames are released in order (a retime
that lowers the delay waits for those queued), so each direction's queue is a sorted deque,
not a heap. A queue holds at most QUEUE_LIMIT_FRAMES (tail drop beyond).

The forwarder is one Python thread, so it carries far less than a veth pair (figures in
docs/lab.md): delay links are for latency experiments, not for bandwidth ones. The lab's side
of it: tsukimi/lab/delay_handle.py.
"""

from __future__ import annotations

import collections
import fcntl
import math
import os
import random
import select
import struct
import sys
import time

from tsukimi.errors import ConfigError
from tsukimi.lab import netns
from tsukimi.lab.delay_handle import Timing

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_READ_BYTES = 65536  # NOTE: a TAP without IFF_VNET_HDR hands over one MTU-sized frame per read
_BATCH_FRAMES = 256  # NOTE: frames read from one TAP per wake-up, so the other side is not starved
QUEUE_LIMIT_FRAMES = 20_000
JITTER_SLOPE = 0.5  # NOTE: < 1, so release times rise with arrival times (see the module)


def open_tap(namespace: str, name: str) -> int:
    """A non-blocking descriptor of a new TAP device `name` (no packet info) made in
    `namespace`; the device lives as long as the descriptor (mutates: leaves the calling
    thread in `namespace`).

    Raises:
        ConfigError: no /dev/net/tun (CONFIG_TUN), no such namespace, or TUNSETIFF refused.
    """
    netns.switch_to(namespace)
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot open /dev/net/tun (the kernel needs CONFIG_TUN): {exc}") from exc
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"cannot make TAP {name} in {namespace}: {exc}") from exc
    return fd


class Jitter:
    """One direction's jitter over time (see the module): `offset_s` is the extra delay of a
    frame arriving at `now_s` (mutates: the walk advances)."""

    __slots__ = ("_at_s", "_rng", "_target_s", "_value_s")

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._at_s: float | None = None
        self._target_s = self._value_s = 0.0

    def offset_s(self, now_s: float, jitter_ms: float) -> float:
        """The offset, in +-`jitter_ms` (as seconds), at `now_s` (not before the last call's)."""
        span_s = jitter_ms / 1000
        step_s = (now_s - (self._at_s if self._at_s is not None else now_s)) * JITTER_SLOPE
        self._at_s = now_s
        if span_s <= 0.0:
            self._target_s = self._value_s = 0.0
            return 0.0
        if step_s > 4 * span_s:  # NOTE: idle long enough to have wandered anywhere: skip the walk
            self._value_s, step_s = self._rng.uniform(-span_s, span_s), 0.0
        while True:
            gap_s = self._target_s - self._value_s
            if abs(gap_s) > step_s:
                self._value_s += math.copysign(step_s, gap_s)
                return self._value_s
            self._value_s, step_s = self._target_s, step_s - abs(gap_s)
            self._target_s = self._rng.uniform(-span_s, span_s)


class _Direction:
    """Frames from one TAP waiting to be written to the other, in release order."""

    __slots__ = ("dst", "jitter", "num_dropped", "queue", "src")

    def __init__(self, src: int, dst: int, rng: random.Random) -> None:
        self.src, self.dst = src, dst
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.jitter = Jitter(rng)
        self.num_dropped = 0

    def receive(self, now_s: float, timing: Timing) -> None:
        """Read up to a batch of frames and queue each with its release time."""
        release_s = now_s + timing.delay_ms / 1000 + self.jitter.offset_s(now_s, timing.jitter_ms)
        if self.queue and release_s < self.queue[-1][0]:
            release_s = self.queue[-1][0]  # NOTE: only after a retime lowered the delay: keep order
        for _ in range(_BATCH_FRAMES):
            try:
                frame = os.read(self.src, _READ_BYTES)
            except BlockingIOError:
                return
            if len(self.queue) >= QUEUE_LIMIT_FRAMES:
                self.num_dropped += 1
                continue
            self.queue.append((release_s, frame))

    def release(self, now_s: float) -> None:
        """Write every frame that is due."""
        queue = self.queue
        while queue and queue[0][0] <= now_s:
            _, frame = queue.popleft()
            try:
                os.write(self.dst, frame)
            except OSError:
                self.num_dropped += 1  # NOTE: the far end is down (link_down): lost, as on a cut cable


def forward(host_fd: int, hub_fd: int, control_fd: int, timing: Timing) -> None:
    """Copy frames between the two TAPs, each held per `timing`, until EOF on `control_fd`
    (whose lines retime the line; each is answered "ok" on stdout)."""
    rng = random.Random()
    poller = select.epoll()
    for fd in (host_fd, hub_fd, control_fd):
        poller.register(fd, select.EPOLLIN)
    directions = {host_fd: _Direction(host_fd, hub_fd, rng), hub_fd: _Direction(hub_fd, host_fd, rng)}
    pending = b""
    while True:
        heads = [d.queue[0][0] for d in directions.values() if d.queue]
        timeout_s = max(0.0, min(heads) - time.monotonic()) if heads else -1.0
        events = poller.poll(timeout_s)
        now_s = time.monotonic()
        for fd, _ in events:
            if fd != control_fd:
                directions[fd].receive(now_s, timing)
                continue
            data = os.read(control_fd, 4096)
            if not data:
                return  # NOTE: the lab closed the link, or its runner died
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                delay_ms, jitter_ms = (float(x) for x in line.split())
                timing = Timing(delay_ms, jitter_ms)
                os.write(1, b"ok\n")
        for direction in directions.values():
            direction.release(now_s)


def main(argv: list[str]) -> int:
    """Make the TAPs, say "ready", forward until the control pipe closes; 0, 1 when the TAPs
    could not be made (said on stdout), 2 on bad arguments."""
    if len(argv) != 6:
        print("usage: python -m tsukimi.lab.delay_line HOST_NS HOST_DEV HUB_NS HUB_DEV DELAY_MS JITTER_MS")
        return 2
    host_ns, host_dev, hub_ns, hub_dev = argv[:4]
    try:
        timing = Timing(float(argv[4]), float(argv[5]))
        host_fd = open_tap(host_ns, host_dev)
        hub_fd = open_tap(hub_ns, hub_dev)  # NOTE: last, so the process stays in the hub (see the module)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", flush=True)
        return 1
    print("ready", flush=True)
    forward(host_fd, hub_fd, sys.stdin.fileno(), timing)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
