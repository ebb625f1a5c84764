"""The load generator's HTTP/1.1 client: one connection per request (h11 over asyncio streams).

Why not httpx: its connection pool (httpcore 1.0) scans every queued request against every
connection each time one is assigned, so with a thousand requests in flight the generator
spent its CPU there and fell minutes behind an open-loop schedule (seen at 4x overload, 60 s).
An open loop must send each request at its time whatever the others do; a fresh loopback
connection per request costs a connect, and no pool can queue a request on the client side.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

_READ_BYTES = 1 << 16


@dataclass(slots=True)
class Answer:
    """An HTTP response whose body is read from its connection as it arrives."""

    status: int
    _conn: h11.Connection
    _reader: asyncio.StreamReader

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they come, until the response ends.

        Raises: h11.ProtocolError on a malformed response or one cut short; OSError."""
        while True:
            event = await _next_event(self._conn, self._reader)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (server-sent events), decoded as UTF-8, without their line ends."""
        pending = b""
        async for chunk in self.chunks():
            *complete, pending = (pending + chunk).split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.decode("utf-8", errors="replace")


@contextlib.asynccontextmanager
async def post_json(url: str, body: bytes) -> AsyncIterator[Answer]:
    """POST `body` (JSON) to `url` on a connection of its own; the response once its head came.
    The connection is closed on the way out. No timeout here: the caller bounds the whole call.

    Raises: OSError (refused, reset), h11.ProtocolError (a malformed or cut response)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=_READ_BYTES)
    try:
        conn = h11.Connection(h11.CLIENT)
        headers = [
            ("Host", parts.netloc),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ]
        writer.write(conn.send(h11.Request(method="POST", target=parts.path or "/", headers=headers)) or b"")
        writer.write(conn.send(h11.Data(data=body)) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        head = await _next_event(conn, reader)
        while isinstance(head, h11.InformationalResponse):
            head = await _next_event(conn, reader)
        if not isinstance(head, h11.Response):
            raise h11.RemoteProtocolError(f"expected a response, got {head!r}")
        yield Answer(head.status_code, conn, reader)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    """The connection's next event, reading from the socket as h11 needs (b"" at its end)."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            if isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("the server closed the connection before the response ended")
            return event
        conn.receive_data(await reader.read(_READ_BYTES))
