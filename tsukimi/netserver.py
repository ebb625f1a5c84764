"""A thread-per-connection TCP server base, shared by the Transfer Engine's segment server
(transfer/server.py) and the control-plane RPC server (rpc/server.py). Every accepted
connection first runs the cluster-secret handshake (tsukimi/auth.py); only a connection that
passes it is served.

NOTE: `ConnectionServer` waits with time.monotonic/time.sleep directly: it supervises real
threads and sockets, which only run on real time."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from tsukimi import auth
from tsukimi.errors import AuthError
from tsukimi.netio import set_io_timeout

logger = logging.getLogger(__name__)

_ACCEPT_BACKOFF_S = 0.05


class ConnectionServer:
    """A TCP listener that serves each connection on a thread of its own.

    Subclasses implement `serve(conn, addr)` and call `start()` at the end of their
    constructor. Each connection's thread first runs the server side of the handshake
    (auth.server_handshake, within `handshake_timeout_s`): a client that fails it, stays
    silent or sends garbage is logged and closed, and `serve` never sees it. The base keeps
    the connection registry (bounded by `max_connections`; a connection over the limit is
    closed at once), survives accept errors (EMFILE, ...), and `close()` wakes every blocked
    thread by shutting its socket down.

    Raises (constructor): OSError when host:port cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        name: str,
        max_connections: int,
        tick_s: float,
        secret: bytes | None = None,
    ) -> None:
        self.name = name
        self._secret = secret
        self.handshake_timeout_s = auth.HANDSHAKE_TIMEOUT_S
        self._max_connections = max_connections
        self._tick_s = tick_s
        self._lock = threading.Lock()  # guards closed, _conns, _threads
        self.closed = False
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self.host, self.port = host, int(self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept, name=f"tsukimi-{name}-accept", daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def serve(self, conn: socket.socket, addr: object) -> None:
        """Serve one connection until it ends (runs on its own thread)."""
        raise NotImplementedError

    def close(self, join_s: float = 5.0) -> None:
        """Stop accepting, drop every connection, wait up to `join_s` for the threads (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            conns, threads = list(self._conns), list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes recv(); the connection's thread closes it
        deadline = time.monotonic() + join_s
        for thread in (self._acceptor, *threads):
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._listener.close()
        if any(thread.is_alive() for thread in threads):
            logger.warning("%s: a connection thread is still busy after %.1f s", self.name, join_s)

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError as exc:
                if self.closed:
                    return
                # EMFILE, ECONNABORTED, ENOBUFS...: keep serving once the pressure eases
                logger.warning("%s: accept failed: %s", self.name, exc)
                time.sleep(_ACCEPT_BACKOFF_S)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_io_timeout(conn, self._tick_s)
            thread = threading.Thread(
                target=self._run, args=(conn, addr), name=f"tsukimi-{self.name}-conn", daemon=True
            )
            with self._lock:  # NOTE: started under the lock, so close() never joins an unstarted thread
                if self.closed or len(self._conns) >= self._max_connections:
                    logger.warning("%s: refusing %s: closed or at the connection limit", self.name, addr)
                    conn.close()
                    continue
                self._conns.add(conn)
                self._threads.add(thread)
                thread.start()

    def _run(self, conn: socket.socket, addr: object) -> None:
        try:
            if self._admit(conn, addr):
                self.serve(conn, addr)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _admit(self, conn: socket.socket, addr: object) -> bool:
        """Run the handshake; False (logged) when the client failed it or left."""
        deadline = time.monotonic() + self.handshake_timeout_s
        try:
            auth.server_handshake(conn, self._secret, auth.deadline_expired(deadline, lambda: self.closed))
        except AuthError as exc:
            logger.warning("%s: refused %s: %s", self.name, addr, exc)
            return False
        except TimeoutError:
            if not self.closed:
                logger.warning("%s: dropped %s: no handshake within %.1f s", self.name, addr, self.handshake_timeout_s)
            return False
        except OSError as exc:
            logger.debug("%s: %s left during the handshake: %s", self.name, addr, exc)
            return False
        return True
