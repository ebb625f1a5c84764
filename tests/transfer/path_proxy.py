"""A second path to a segment server on loopback, for stall tests: a TCP proxy listening on
127.0.0.2 that forwards to the real server, optionally at a limited rate (a slow but alive
link), and that can be cut: from then on it neither reads nor writes on any connection and
forwards nothing for new ones, while the sockets stay open (a NIC that died silently: no
reset, no progress)."""

from __future__ import annotations

import socket
import threading
import time

from tsukimi.transfer.segment import Endpoint

CHUNK_BYTES = 64 << 10


class PathProxy:
    """Forwards 127.0.0.2:`port` to `target`; `rate_bps` bounds the client-to-server way."""

    def __init__(self, target: Endpoint, rate_bps: float | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.2", 0))
        self.endpoint = Endpoint("127.0.0.2", self.listener.getsockname()[1])
        self.target = target
        self.rate_bps = rate_bps
        self.cut = threading.Event()
        self.closed = False
        self.connections = 0
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.cut.set()
        self.listener.close()
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self._sockets.append(client)
            if self.cut.is_set():
                continue  # accepted, never answered
            server = socket.create_connection((self.target.host, self.target.port))
            self._sockets.append(server)
            threading.Thread(target=self._pump, args=(client, server, self.rate_bps), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, rate_bps: float | None) -> None:
        src.settimeout(0.05)
        while not self.cut.is_set():
            try:
                data = src.recv(CHUNK_BYTES)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data or self.cut.is_set():
                return  # NOTE: cut: the bytes read are dropped, nothing is closed
            try:
                dst.sendall(data)
            except OSError:
                return
            if rate_bps:
                time.sleep(len(data) * 8 / rate_bps)
