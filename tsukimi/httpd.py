"""Serving an ASGI app (FastAPI) with uvicorn on our own listening socket, in the foreground
or in a daemon thread, and the HTTP side of the cluster secret: `sign_request` (client) and
`check_signature` (server), over tsukimi/auth.py's signed headers (covering the method, path,
query, body and the conditional headers If-Match / If-None-Match). Shared by the metadata
server and the store master's HTTP endpoints.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import httpx
import uvicorn
from fastapi import FastAPI, HTTPException, Request

from tsukimi import auth
from tsukimi.clock import WallClock
from tsukimi.errors import AuthError, PeerError

logger = logging.getLogger(__name__)

SIGNED_HEADERS = ("if-match", "if-none-match")  # signed beside the method, path, query and body


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0 = ephemeral).

    NOTE: it must say proto=IPPROTO_TCP: accepted sockets inherit the listener's proto, and
    asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP. Without it, uvicorn's
    separate header and body writes meet delayed ACKs: ~40 ms per request. (socket.create_server
    and uvicorn.run(host=, port=) pass proto=0.)
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def sign_request(request: httpx.Request, secret: bytes | None) -> httpx.Request:
    """Add the signature headers to `request` (mutates it; no-op without a secret).

    Build it with `client.build_request(...)` and a bytes body, then `client.send(...)` it.
    """
    if secret is not None:
        path = request.url.raw_path.decode("ascii")  # path and query, exactly as sent
        target = signed_target(path, request.headers.get_list)
        request.headers.update(auth.sign_headers(secret, request.method, target, request.content))
    return request


def signed_target(path_with_query: str, header_values: Callable[[str], list[str]]) -> str:
    """What a signature covers of a request's target: the path and query, then each value
    of the SIGNED_HEADERS it carries, as "\nname:value" lines.

    NOTE: the conditional headers decide whether a write happens: a signature that left them
    out would let anyone on the path strip If-Match and turn a compare-and-set into a blind
    write. A request line holds no newline, so the two parts cannot be confused. Requests
    without those headers are signed exactly as before.
    """
    lines = [f"\n{name}:{value}" for name in SIGNED_HEADERS for value in header_values(name)]
    return path_with_query + "".join(lines)


def check_signature(request: Request, body: bytes, secret: bytes | None, replay_cache: auth.ReplayCache) -> None:
    """Refuse a request that is not signed with `secret` (no-op without a secret). Call it
    in a route after reading the (bounded) body and before touching anything.

    Raises:
        HTTPException: 401 with the reason (unsigned, bad signature, clock skew, replay).
    """
    if secret is None:
        return
    raw_path = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string") or b""
    path = (raw_path + b"?" + query if query else raw_path).decode("latin-1")
    target = signed_target(path, request.headers.getlist)
    try:
        auth.verify_headers(
            secret, request.method, target, body, request.headers, auth.wall_time(), replay_cache=replay_cache
        )
    except AuthError as exc:
        logger.warning("refused %s %s from %s: %s", request.method, request.url.path, request.client, exc)
        raise HTTPException(401, detail=str(exc)) from exc


def serve(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Run `app` in the foreground until SIGINT/SIGTERM (blocks)."""
    sock = listen(host, port)
    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])


class AppHandle:
    """An app served from a daemon thread; `stop()` shuts it down."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, sock: socket.socket) -> None:
        self._server = server
        self._thread = thread
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def thread(self) -> threading.Thread:
        """The thread serving the app (alive while it serves)."""
        return self._thread

    def stop(self, timeout_s: float = 5.0) -> None:
        """Shut down gracefully, then forcibly; idempotent. Waits at most about `timeout_s`."""
        self._server.should_exit = True
        self._thread.join(timeout_s / 2)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s / 2)
        self._sock.close()
        if self._thread.is_alive():
            logger.warning("HTTP server thread on port %d did not stop", self.port)

    def __enter__(self) -> AppHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


H = TypeVar("H", bound=AppHandle)


def start_in_thread(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout_s: float = 5.0,
    handle_type: type[H] = AppHandle,  # type: ignore[assignment]
) -> H:
    """Serve `app` from a daemon thread; returns (a `handle_type`) once it accepts connections.

    Raises:
        OSError: the address cannot be bound.
        PeerError: the server did not start within `startup_timeout_s`.
    """
    sock = listen(host, port)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    name = f"http-{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=name)
    handle = handle_type(server, thread, sock)
    thread.start()
    clock = WallClock()  # NOTE: waiting on a real server thread needs real time.
    deadline = clock.now() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or clock.now() > deadline:
            handle.stop()
            raise PeerError(f"HTTP server on {handle.base_url} did not start within {startup_timeout_s} s")
        clock.sleep(0.005)
    return handle
