"""Mooncake's HTTP metadata protocol, extended: the embedded server (`create_app`, `serve`,
`start_in_thread`) and the wire helpers its client (`HttpMetadata`, http_client.py) shares.

Mooncake's protocol (its `http_metadata_server`), all on one path with the key in the query,
kept byte for byte (its own clients use it):

    GET    /metadata?key=K   -> 200 raw value bytes | 404
    PUT    /metadata?key=K   (raw body) -> 200
    DELETE /metadata?key=K   -> 200 | 404
    GET    /health           -> 200 {"status": "ok"}

tsukimi's additions, in HTTP's own terms (old clients never send them):

    GET and PUT answers carry the key's revision as an ETag: `ETag: "17"`.
    PUT    /metadata?key=K  If-Match: "17"     -> 200 + ETag | 412: written only at revision 17
    PUT    /metadata?key=K  If-None-Match: *   -> 200 + ETag | 412: written only if absent
    DELETE /metadata?key=K  If-Match: "17"     -> 200 | 412 (another revision, or no key)
    PUT    /metadata?key=K&ttl_s=S             -> 200 + ETag: ephemeral, gone S s after the last
                                                  such PUT (timed here, on the server)
    GET    /metadata/list?prefix=P             -> 200 msgpack map {key: [value (bin), revision]}

The conditional checks are atomic: they are the server's backend's compare_and_set and
compare_and_delete; writes through one server are serialized, so that a PUT's ETag is the
revision that PUT wrote. Invalid requests get 400 (missing, empty or oversized key or prefix,
bad Content-Length, malformed If-Match, both conditions, If-None-Match on DELETE, a condition
with ttl_s, ttl_s outside [MIN_TTL_S, MAX_TTL_S]) or 413 (value over the limit); 412 on a
lost compare-and-set; 500 when the backend fails (a list over MAX_LIST_KEYS). Error bodies
are JSON `{"detail": message}`. The server keeps its data in any `MetadataBackend`, by
default a private `MemoryMetadata`.

With the cluster secret, every /metadata request must carry tsukimi/auth.py's signature
headers (the client adds them; they cover the method, path, query, body, If-Match and
If-None-Match): an unsigned, badly signed, stale (> 30 s) or replayed request gets 401 with
the reason, before the store is touched. /health stays open.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import msgspec
from fastapi import FastAPI, HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

from tsukimi import auth, httpd
from tsukimi.errors import ConfigError, MetadataError, PeerError, RevisionConflict
from tsukimi.transfer.metadata.base import (
    MAX_VALUE_BYTES,
    MetadataBackend,
    check_key,
    check_prefix,
    check_ttl,
)
from tsukimi.transfer.metadata.memory import MemoryMetadata

logger = logging.getLogger(__name__)

METADATA_PATH = "/metadata"
LIST_PATH = METADATA_PATH + "/list"
_MAX_REVISION = (1 << 63) - 1
_P = ParamSpec("_P")
_T = TypeVar("_T")


def etag(revision: int) -> str:
    """The ETag (and If-Match) form of a revision: `"17"`."""
    return f'"{revision}"'


def parse_etag(text: str) -> int | None:
    """The revision in an ETag or If-Match value `"N"` (1 <= N < 2**63), or None (pure)."""
    text = text.strip()
    digits = text[1:-1]
    if not (text.startswith('"') and text.endswith('"') and digits.isascii() and digits.isdigit()):
        return None
    if len(digits) > 19:
        return None
    revision = int(digits)
    return revision if 0 < revision <= _MAX_REVISION else None


def create_app(
    store: MetadataBackend | None = None, *, max_value_bytes: int = MAX_VALUE_BYTES, secret: bytes | None = None
) -> FastAPI:
    """The metadata server as an ASGI app.

    Args:
        store: where values live; a fresh private `MemoryMetadata` when None.
        max_value_bytes: largest accepted PUT body (413 above it).
        secret: the cluster secret requests must be signed with; None accepts any request.
    """
    backend: MetadataBackend = store if store is not None else MemoryMetadata()
    seen = auth.ReplayCache()
    writes = _Writes(backend)
    app = FastAPI(title="tsukimi metadata server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(METADATA_PATH)
    async def get_value(request: Request) -> Response:
        httpd.check_signature(request, b"", secret, seen)
        key = _key_of(request)
        entry = await run_in_threadpool(backend.get_versioned, key)
        if entry is None:
            return Response(b"metadata not found", status_code=404, media_type="text/plain")
        return Response(entry.value, media_type="application/octet-stream", headers={"ETag": etag(entry.revision)})

    @app.put(METADATA_PATH)
    async def put_value(request: Request) -> Response:
        key = _key_of(request)
        value = await _read_body(request, max_value_bytes)
        httpd.check_signature(request, value, secret, seen)
        expected, ttl_s = _condition_of(request), _ttl_of(request)
        if expected is not None and ttl_s is not None:
            raise HTTPException(400, detail="a conditional PUT cannot be ephemeral (ttl_s)")
        revision = await _run(writes.put, key, value, expected, ttl_s)
        headers = {} if revision is None else {"ETag": etag(revision)}
        return Response(b"metadata updated", media_type="text/plain", headers=headers)

    @app.delete(METADATA_PATH)
    async def delete_value(request: Request) -> Response:
        httpd.check_signature(request, b"", secret, seen)
        key = _key_of(request)
        expected = _condition_of(request)
        if expected == 0:
            raise HTTPException(400, detail="DELETE takes If-Match with a revision, not If-None-Match")
        if not await _run(writes.delete, key, expected):
            return Response(b"metadata not found", status_code=404, media_type="text/plain")
        return Response(b"metadata deleted", media_type="text/plain")

    @app.get(LIST_PATH)
    async def list_values(request: Request) -> Response:
        httpd.check_signature(request, b"", secret, seen)
        prefix = _checked(request, "prefix", check_prefix)
        entries = await _run(backend.list_prefix, prefix)
        body = msgspec.msgpack.encode({key: (entry.value, entry.revision) for key, entry in entries.items()})
        return Response(body, media_type="application/msgpack")

    return app


class _Writes:
    """The server's writes, one at a time (a PUT's ETag is then the revision it wrote, and
    Mooncake's DELETE knows whether the key existed)."""

    def __init__(self, backend: MetadataBackend) -> None:
        self._backend = backend
        self._lock = threading.Lock()

    def put(self, key: str, value: bytes, expected: int | None, ttl_s: float | None) -> int | None:
        """The new revision (None if the backend no longer has the key). Raises RevisionConflict."""
        with self._lock:
            if expected is not None:
                return self._backend.compare_and_set(key, value, expected)
            if ttl_s is None:
                self._backend.put(key, value)
            else:
                self._backend.put_ephemeral(key, value, ttl_s)
            entry = self._backend.get_versioned(key)
        return None if entry is None else entry.revision

    def delete(self, key: str, expected: int | None) -> bool:
        """Whether the key existed. Raises RevisionConflict."""
        with self._lock:
            if expected is not None:
                self._backend.compare_and_delete(key, expected)
                return True
            existed = self._backend.get_versioned(key) is not None
            self._backend.delete(key)
            return existed


async def _run(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`fn` on the thread pool, its expected failures as HTTP answers."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except RevisionConflict as exc:
        raise HTTPException(412, detail=str(exc)) from exc
    except MetadataError as exc:
        raise HTTPException(500, detail=str(exc)) from exc


def _checked(request: Request, name: str, check: Callable[[str], object]) -> str:
    text = request.query_params.get(name)
    if text is None:
        raise HTTPException(400, detail=f"query parameter {name!r} is required")
    try:
        check(text)
    except ConfigError as exc:
        raise HTTPException(400, detail=str(exc)) from exc
    return text


def _key_of(request: Request) -> str:
    return _checked(request, "key", check_key)


def _ttl_of(request: Request) -> float | None:
    text = request.query_params.get("ttl_s")
    if text is None:
        return None
    try:
        ttl_s = float(text)
        check_ttl(ttl_s)
    except (ValueError, ConfigError) as exc:  # ConfigError is a ValueError: one message for both
        raise HTTPException(400, detail=f"bad ttl_s {text[:40]!r}: {exc}") from exc
    return ttl_s


def _condition_of(request: Request) -> int | None:
    """The expected revision a request states: If-Match "N" -> N, If-None-Match * -> 0, none -> None."""
    matches, absent = request.headers.getlist("if-match"), request.headers.getlist("if-none-match")
    if len(matches) + len(absent) > 1:
        raise HTTPException(400, detail="at most one If-Match or If-None-Match header")
    if absent:
        if absent[0].strip() != "*":
            raise HTTPException(400, detail=f"If-None-Match takes only *, got {absent[0][:40]!r}")
        return 0
    if not matches:
        return None
    revision = parse_etag(matches[0])
    if revision is None:
        raise HTTPException(400, detail=f'If-Match takes one revision as an ETag, e.g. "17"; got {matches[0][:40]!r}')
    return revision


async def _read_body(request: Request, limit: int) -> bytes:
    # NOTE: trust but verify: reject on the declared length before reading anything, then
    # count while streaming, since a chunked body declares no length at all.
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise HTTPException(400, detail=f"invalid Content-Length {declared!r}")
        if int(declared) > limit:
            raise HTTPException(413, detail=f"value is {declared} bytes, the limit is {limit}")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise HTTPException(413, detail=f"value exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def serve(
    host: str = "127.0.0.1", port: int = 8080, *, store: MetadataBackend | None = None, secret: bytes | None = None
) -> None:
    """Run the metadata server in the foreground until interrupted (blocks)."""
    signed = " (signed requests only)" if secret else ""
    logger.info("metadata server listening on http://%s:%d%s%s", host, port, METADATA_PATH, signed)
    httpd.serve(create_app(store, secret=secret), host, port)


class ServerHandle(httpd.AppHandle):
    """A metadata server running in a daemon thread; `stop()` shuts it down."""

    @property
    def url(self) -> str:
        """The client URL, `http://host:port/metadata`."""
        return self.base_url + METADATA_PATH


def start_in_thread(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    store: MetadataBackend | None = None,
    max_value_bytes: int = MAX_VALUE_BYTES,
    startup_timeout_s: float = 5.0,
    secret: bytes | None = None,
) -> tuple[ServerHandle, int]:
    """Start the metadata server in a daemon thread and wait until it accepts connections.

    Returns:
        The handle and the port actually bound (useful with `port=0`).
    Raises:
        OSError: the address cannot be bound.
        MetadataError: the server did not start within `startup_timeout_s`.
    """
    app = create_app(store, max_value_bytes=max_value_bytes, secret=secret)
    try:
        handle = httpd.start_in_thread(app, host, port, startup_timeout_s, handle_type=ServerHandle)
    except PeerError as exc:
        raise MetadataError(str(exc)) from exc
    logger.info("metadata server started on %s", handle.base_url)
    return handle, handle.port


_listen = httpd.listen  # kept for the regression test of the Nagle fix
