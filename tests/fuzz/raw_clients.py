"""Raw-socket clients for the fuzz targets: send arbitrary bytes to a server, read all it answers.

A server may greet each connection first (tsukimi/auth.py: 40 bytes starting "TSKA", sent
even without a cluster secret); `Greeter` finds out once per server whether it does and then
skips the greeting on every connection, so the fuzzers work with and without it.
"""

from __future__ import annotations

import select
import socket
import struct
import time

GREETING_MAGIC = b"TSKA"
GREETING_BYTES = 40
_PROBE_S = 1.0


class NoEof(AssertionError):
    """The server neither answered nor closed the connection in time (a hang)."""


class Greeter:
    """Connects to one server, consuming its greeting when it sends one."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)
        self.greets = self._probe()

    def _probe(self) -> bool:
        with socket.create_connection(self.address, timeout=5.0) as sock:
            readable, _, _ = select.select([sock], [], [], _PROBE_S)
            return bool(readable) and sock.recv(len(GREETING_MAGIC), socket.MSG_PEEK) == GREETING_MAGIC

    def connect(self, timeout_s: float = 5.0) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=timeout_s)
        if self.greets:
            greeting = recv_exactly(sock, GREETING_BYTES)
            assert greeting.startswith(GREETING_MAGIC), greeting
        return sock

    def exchange(self, data: bytes, timeout_s: float = 10.0) -> tuple[bytes, bool]:
        """Send `data`, half-close, and read until the server closes.

        Returns:
            (what the server sent, whether it reset the connection instead of closing it).
        Raises:
            NoEof: the server kept the connection open past `timeout_s`.
        """
        with self.connect(timeout_s) as sock:
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # the server closed early (e.g. an oversized length): read what it said
                pass
            return read_to_eof(sock, timeout_s)


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionResetError(f"closed after {len(buf)} of {size} bytes")
        buf += chunk
    return bytes(buf)


def read_to_eof(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoEof(f"no EOF within {timeout_s} s after {sum(map(len, chunks))} bytes")
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 20)
        except ConnectionResetError:
            return b"".join(chunks), True
        except TimeoutError:
            continue
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)


def http_status(host: str, port: int, request: bytes, timeout_s: float = 10.0) -> int | None:
    """Send one raw HTTP request; the status code of the answer, or None when the server
    closed without answering."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        data, _ = read_to_eof(sock, timeout_s)
    if not data:
        return None
    line = data.split(b"\r\n", 1)[0].split(b" ")
    assert len(line) >= 2 and line[0].startswith(b"HTTP/1."), data[:200]
    return int(line[1])


def split_frames(
    data: bytes, header: struct.Struct, length_at: int
) -> tuple[list[tuple[tuple[int, ...], bytes]], bytes]:
    """Cut a byte stream into (header fields, payload) frames; also returns the unparsed tail."""
    frames = []
    pos = 0
    while len(data) - pos >= header.size:
        fields = header.unpack_from(data, pos)
        end = pos + header.size + fields[length_at]
        if end > len(data):
            break
        frames.append((fields, data[pos + header.size : end]))
        pos = end
    return frames, data[pos:]
