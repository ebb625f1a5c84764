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

Each frame leaves at max(arrival + delay + uniform(-jitter, +jitter), the previous frame's
release in that direction): jitter spreads latency but never reorders frames (netem reorders
unless rate-limited; reordering makes TCP retransmit, which a latency experiment does not want).
Each direction's queue is therefore sorted: a deque, not a heap. A queue holds at most
QUEUE_LIMIT_FRAMES (tail drop beyond). The forwarder is one Python thread, so it carries far
less than a veth pair (figures in docs/lab.md): delay links are for latency experiments, not
for bandwidth ones. The lab's side of it: tsukimi/lab/delay_handle.py.
"""

from __future__ import annotations

import collections
import fcntl
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


class _Direction:
    """Frames from one TAP waiting to be written to the other, in release order."""

    __slots__ = ("dst", "num_dropped", "queue", "src")

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst = src, dst
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.num_dropped = 0

    def receive(self, now_s: float, timing: Timing, rng: random.Random) -> None:
        """Read up to a batch of frames and queue each with its release time."""
        for _ in range(_BATCH_FRAMES):
            try:
                frame = os.read(self.src, _READ_BYTES)
            except BlockingIOError:
                return
            if len(self.queue) >= QUEUE_LIMIT_FRAMES:
                self.num_dropped += 1
                continue
            release_s = timing.release_s(now_s, rng)
            if self.queue and release_s < self.queue[-1][0]:
                release_s = self.queue[-1][0]  # NOTE: jitter never reorders (see the module)
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
    directions = {host_fd: _Direction(host_fd, hub_fd), hub_fd: _Direction(hub_fd, host_fd)}
    pending = b""
    while True:
        heads = [d.queue[0][0] for d in directions.values() if d.queue]
        timeout_s = max(0.0, min(heads) - time.monotonic()) if heads else -1.0
        events = poller.poll(timeout_s)
        now_s = time.monotonic()
        for fd, _ in events:
            if fd != control_fd:
                directions[fd].receive(now_s, timing, rng)
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
