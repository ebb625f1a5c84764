"""Mooncake's HTTP metadata protocol: the embedded server and the `HttpMetadata` client.

The protocol (Mooncake's `http_metadata_server`), all on one path with the key in the query:

    GET    /metadata?key=K   -> 200 raw value bytes | 404
    PUT    /metadata?key=K   (raw body) -> 200
    DELETE /metadata?key=K   -> 200 | 404
    GET    /health           -> 200 {"status": "ok"}

Invalid requests get 400 (missing, empty or oversized key, bad Content-Length) or 413 (value
over the limit), with a JSON body `{"detail": message}`. The server keeps its data in any
`MetadataBackend`, by default a private `MemoryMetadata`.

With the cluster secret, every /metadata request must carry tsukimi/auth.py's signature
headers (the client adds them): an unsigned, badly signed, stale (> 30 s) or replayed request
gets 401 with the reason, before the store is touched. /health stays open.
"""

from __future__ import annotations

import logging

import httpx
from fastapi import FastAPI, HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

from tsukimi import auth, httpd
from tsukimi.errors import AuthError, ClosedError, ConfigError, MetadataError, PeerError
from tsukimi.transfer.metadata.base import MAX_VALUE_BYTES, MetadataBackend, check_key, check_value
from tsukimi.transfer.metadata.memory import MemoryMetadata

logger = logging.getLogger(__name__)

METADATA_PATH = "/metadata"
_CALLER_FAULT_STATUSES = frozenset({400, 413, 414, 422})


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
    app = FastAPI(title="tsukimi metadata server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(METADATA_PATH)
    async def get_value(request: Request) -> Response:
        httpd.check_signature(request, b"", secret, seen)
        key = _key_of(request)
        value = await run_in_threadpool(backend.get, key)
        if value is None:
            return Response(b"metadata not found", status_code=404, media_type="text/plain")
        return Response(value, media_type="application/octet-stream")

    @app.put(METADATA_PATH)
    async def put_value(request: Request) -> Response:
        key = _key_of(request)
        value = await _read_body(request, max_value_bytes)
        httpd.check_signature(request, value, secret, seen)
        await run_in_threadpool(backend.put, key, value)
        return Response(b"metadata updated", media_type="text/plain")

    @app.delete(METADATA_PATH)
    async def delete_value(request: Request) -> Response:
        httpd.check_signature(request, b"", secret, seen)
        key = _key_of(request)
        existed = await run_in_threadpool(backend.get, key) is not None
        await run_in_threadpool(backend.delete, key)
        if not existed:
            return Response(b"metadata not found", status_code=404, media_type="text/plain")
        return Response(b"metadata deleted", media_type="text/plain")

    return app


def _key_of(request: Request) -> str:
    key = request.query_params.get("key")
    if key is None:
        raise HTTPException(400, detail="query parameter 'key' is required")
    try:
        check_key(key)
    except ConfigError as exc:
        raise HTTPException(400, detail=str(exc)) from exc
    return key


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


class HttpMetadata:
    """A `MetadataBackend` client of the HTTP metadata protocol (thread-safe).

    Args:
        url: `http://host:port/metadata`; the key is sent as the `?key=` query parameter.
        timeout_s: connect, read and write timeout of each request.
        secret: the cluster secret every request is signed with; None sends them unsigned.
    Raises:
        ConfigError: malformed URL or non-positive timeout.
    """

    def __init__(self, url: str, timeout_s: float = 5.0, *, secret: bytes | None = None) -> None:
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise ConfigError(f"invalid metadata URL {url!r}: {exc}") from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigError(f"metadata URL must look like http://HOST:PORT/metadata, got {url!r}")
        if timeout_s <= 0:
            raise ConfigError(f"metadata timeout_s must be > 0, got {timeout_s}")
        self.url = url
        self._secret = secret
        # NOTE: trust_env=False: an HTTP(S)_PROXY in the environment must not capture loopback.
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s), trust_env=False)
        self._closed = False

    def get(self, key: str) -> bytes | None:
        """The value under `key`, or None on 404.

        Raises:
            ClosedError, ConfigError (invalid key, server rejected it), AuthError (the server
            refused the signature), MetadataError (network, 5xx).
        """
        response = self._request("GET", key)
        if response.status_code == 404:
            return None
        self._expect(response, "GET", key, ok=(200,))
        return response.content

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key` on the server (mutates remote state).

        Raises:
            ClosedError, ConfigError (invalid key, oversized value), AuthError (the server
            refused the signature), MetadataError (network, 5xx).
        """
        check_value(value)
        response = self._request("PUT", key, bytes(value))
        self._expect(response, "PUT", key, ok=(200, 201, 204))

    def delete(self, key: str) -> None:
        """Remove `key` on the server; a missing key (404) is fine (mutates remote state).

        Raises:
            ClosedError, ConfigError (invalid key), AuthError (the server refused the signature),
            MetadataError (network, 5xx).
        """
        response = self._request("DELETE", key)
        self._expect(response, "DELETE", key, ok=(200, 202, 204, 404))

    def close(self) -> None:
        """Close the connection pool; idempotent."""
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> HttpMetadata:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _request(self, method: str, key: str, content: bytes | None = None) -> httpx.Response:
        if self._closed:
            raise ClosedError("HttpMetadata client is closed")
        check_key(key)
        try:
            request = self._client.build_request(method, self.url, params={"key": key}, content=content)
            return self._client.send(httpd.sign_request(request, self._secret))
        except httpx.TimeoutException as exc:
            raise MetadataError(f"metadata server {self.url} timed out on {method} {key!r}") from exc
        except httpx.HTTPError as exc:
            raise MetadataError(f"metadata server {self.url} failed on {method} {key!r}: {exc!r}") from exc

    def _expect(self, response: httpx.Response, method: str, key: str, ok: tuple[int, ...]) -> None:
        status = response.status_code
        if status in ok:
            return
        try:
            body = response.json()
        except ValueError:
            body = None
        detail = str(body["detail"]) if isinstance(body, dict) and "detail" in body else response.text[:200]
        message = f"metadata server {self.url} answered {status} to {method} {key!r}: {detail}"
        if status == 401:
            raise AuthError(message)
        if status in _CALLER_FAULT_STATUSES:
            raise ConfigError(message)
        raise MetadataError(message)
