"""Stall detection for pooled tcp connections: what counts as progress on a path, and when
its silence means the path died.

A cut cable (a NIC taken down, a switch port dead) sends no reset: a connection over it
neither breaks nor progresses, and its slices would wait for their request's deadline. A
connection's receiver thread (tcp_connection.py) asks, at each I/O tick it spends waiting
for an answer (never on the data path itself), whether the path progressed since the last
tick: the slice it waits for, the bytes of it received, or the kernel's counters of our
bytes the peer acknowledged and of its bytes received (TCP_INFO `tcpi_bytes_acked`,
`tcpi_bytes_received`, Linux). A write streaming over a slow link therefore keeps
progressing while its answer is pending; a dead link shows nothing at all.

`StallPolicy` then decides:
- silent for `stall_s` while another path of the same pool progressed: stalled;
- silent for `lone_stall_s` (much longer) with the peer's kernel not answering either
  (bytes of ours unacknowledged, or keepalive probes unanswered: the peer host is gone or
  unreachable, not just slow to answer): stalled, even with no other path to compare with.
A stalled connection is broken with `BrokenConnectionError`, not a timeout, so the pool
retries its slices on another path and marks its path suspect (tcp.py).

NOTE: a false positive (a slow but alive path) costs a resend, never a lost or corrupt slice:
a READ is idempotent, and a resent WRITE writes the same bytes to the same destination
offsets; the transfer is acknowledged only when every slice's answer arrived, and the broken
connection is closed before the retry, so no answer of the old one is ever read. A late
write of the old connection that the server still applies lands the very same bytes (the
caller may not reuse the buffer before the batch ends, as for any transfer). The suspect mark
expires (tcp.py), so a slow path is used again.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

# NOTE: offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h): tcpi_probes is the 4th
# byte, tcpi_unacked the 6th u32 after 8 bytes of u8 fields, tcpi_bytes_acked and
# tcpi_bytes_received the two u64 after tcpi_max_pacing_rate (kernel >= 4.1).
_TCP_INFO_BYTES = 136
_PROBES_AT, _UNACKED_AT, _BYTES_AT = 3, 24, 120
_BYTES, _UNACKED = struct.Struct("=QQ"), struct.Struct("=I")
KEEPALIVE_IDLE_S = 1  # probes on an idle connection answer "is the peer's kernel there"
KEEPALIVE_COUNT = 60  # NOTE: high: the stall policy decides, not the kernel's keepalive


@dataclass(frozen=True, slots=True)
class PathProgress:
    """The kernel's view of one connection: bytes of ours the peer acknowledged, bytes of
    its received, and whether it leaves data or keepalive probes of ours unanswered."""

    acked_bytes: int
    received_bytes: int
    peer_unanswered: bool


def read_progress(sock: socket.socket) -> PathProgress | None:
    """The kernel's counters for `sock`; None where TCP_INFO is missing or too short (not
    Linux, an old kernel, a closed socket). Does not mutate."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError):  # AttributeError: no TCP_INFO on this platform
        return None
    if len(info) < _TCP_INFO_BYTES:
        return None
    acked, received = _BYTES.unpack_from(info, _BYTES_AT)
    (unacked,) = _UNACKED.unpack_from(info, _UNACKED_AT)
    return PathProgress(acked, received, unacked > 0 or info[_PROBES_AT] > 0)


def enable_keepalive(sock: socket.socket) -> None:
    """Have the kernel probe `sock` after KEEPALIVE_IDLE_S of silence (mutates the socket),
    so that a read waiting on a dead path shows unanswered probes; where the options exist."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


@dataclass(frozen=True, slots=True)
class StallPolicy:
    """When a silent connection counts as stalled (see the module).

    stall_s: silence that breaks a connection while another path of its pool progressed.
    lone_stall_s: silence that breaks it without such a comparison, when the peer's kernel
        leaves our data or probes unanswered as well.
    """

    stall_s: float
    lone_stall_s: float

    def stalled(self, silent_s: float, other_path_progressed: bool, peer_unanswered: bool) -> bool:
        """Whether a connection silent for `silent_s` is stalled (pure)."""
        if silent_s >= self.stall_s and other_path_progressed:
            return True
        return silent_s >= self.lone_stall_s and peer_unanswered
