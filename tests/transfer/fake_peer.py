"""A scripted segment server for fault tests: it speaks the wire protocol but decides itself
when (and whether) to answer, and can drop the first connection it gets. Also `connect_raw`,
a raw client connection to a segment server, past its (secret-less) greeting."""

from __future__ import annotations

import socket
import threading
import time
import uuid

from tsukimi import auth
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.transfer import TransferEngine, wire
from tsukimi.transfer.metadata import SEGMENT_PREFIX
from tsukimi.transfer.metadata.memory import MemoryMetadata
from tsukimi.transfer.segment import BufferDescriptor, Endpoint, SegmentDescriptor, encode_descriptor

BASE = 0x100000


def connect_raw(endpoint: Endpoint, handshake: bool = True, timeout_s: float = 5.0) -> socket.socket:
    """A raw TCP connection to a segment server; past the greeting unless `handshake` is False."""
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
    if handshake:
        auth.client_handshake(sock, None, auth.deadline_expired(time.monotonic() + timeout_s))
    return sock


class FakePeer:
    """Records requests; answers READs with `fill` bytes once `answer` is set."""

    def __init__(self, answer: bool = True, fill: int = 0xAB, drop_first: bool = False) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.answer = threading.Event()
        if answer:
            self.answer.set()
        self.fill = fill
        self.drop_first = drop_first
        self.connections = 0
        self.requests: list[tuple[int, int, int]] = []  # (op, offset, length)
        self.payloads: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def descriptor(self, name: str = "fake") -> SegmentDescriptor:
        return SegmentDescriptor(
            name, "another-host", 1, 1, [Endpoint("127.0.0.1", self.port)], [BufferDescriptor(BASE, 1 << 24)]
        )

    def close(self) -> None:
        self.answer.set()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn:
            try:
                conn.sendall(auth.encode_greeting(False, bytes(auth.NONCE_BYTES)))  # no secret
                while True:
                    head = bytearray(wire.REQUEST.size)
                    wire.recv_exact(conn, memoryview(head))
                    _magic, op, _flags, seq, offset, length = wire.REQUEST.unpack(head)
                    if number == 1 and self.drop_first:
                        return  # the connection breaks mid-request
                    self.requests.append((op, offset, length))
                    if op == wire.Op.WRITE:
                        body = bytearray(length)
                        wire.recv_exact(conn, memoryview(body))
                        self.payloads.append(bytes(body))
                    self.answer.wait()
                    data = bytes([self.fill]) * length if op == wire.Op.READ else b""
                    conn.sendall(wire.RESPONSE.pack(wire.MAGIC, 0, 0, seq, len(data)) + data)
            except OSError:
                return


def engine_for(peer: FakePeer, **transfer: object) -> TransferEngine:
    """An engine whose metadata lists `peer` as segment "fake" (tcp forced)."""
    store = f"fake-{uuid.uuid4().hex}"
    MemoryMetadata.named(store).put(SEGMENT_PREFIX + "fake", encode_descriptor(peer.descriptor()))
    fields: dict[str, object] = {"transport": "tcp", **transfer}
    cfg = Config(transfer=TransferConfig(**fields), metadata=MetadataConfig(url=f"memory://{store}"))  # type: ignore[arg-type]
    return TransferEngine("me", cfg)
