"""`HttpMetadata`: the client of the HTTP metadata protocol (tsukimi/transfer/metadata/http.py
describes the wire), a `MetadataBackend` over httpx.

Status codes map onto tsukimi's errors: 400/413/414/422 -> ConfigError (the caller's fault),
401 -> AuthError, 412 -> RevisionConflict, anything else unexpected, a 5xx or a network
failure -> MetadataError. Every request has the client's timeout.

The revision calls need tsukimi's server: Mooncake's own `http_metadata_server` ignores
If-Match and ttl_s (a compare-and-set would write blindly, then fail for want of an ETag).

Ephemeral keys are timed by the server. `close()` withdraws the ones this handle still owns:
a DELETE with If-Match of the revision its last `put_ephemeral` of the key wrote, so that a key
written since by anyone else stays.
"""

from __future__ import annotations

import logging
import threading

import httpx
import msgspec

from tsukimi import httpd
from tsukimi.errors import AuthError, ClosedError, ConfigError, MetadataError, RevisionConflict
from tsukimi.transfer.metadata.base import (
    Versioned,
    check_key,
    check_prefix,
    check_revision,
    check_ttl,
    check_value,
)
from tsukimi.transfer.metadata.http import etag, parse_etag

logger = logging.getLogger(__name__)

_CALLER_FAULT_STATUSES = frozenset({400, 413, 414, 422})
_Listing = dict[str, tuple[bytes, int]]


class HttpMetadata:
    """A `MetadataBackend` client of the HTTP metadata protocol (thread-safe).

    Args:
        url: `http://host:port/metadata`; the key is sent as the `?key=` query parameter,
            listings go to the URL + "/list".
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
        self._list_url = str(parsed.copy_with(path=parsed.path.rstrip("/") + "/list", query=None))
        self._secret = secret
        # NOTE: trust_env=False: an HTTP(S)_PROXY in the environment must not capture loopback.
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s), trust_env=False)
        self._closed = False
        self._lock = threading.Lock()
        self._ephemeral: dict[str, int] = {}  # key -> the revision our last put_ephemeral wrote

    def get(self, key: str) -> bytes | None:
        """The value under `key`, or None on 404.

        Raises:
            ClosedError, ConfigError (invalid key, server rejected it), AuthError (the server
            refused the signature), MetadataError (network, 5xx).
        """
        found = self._get(key)
        return None if found is None else found.content

    def get_versioned(self, key: str) -> Versioned | None:
        """The value under `key` with its revision (the ETag), or None on 404.

        Raises:
            ClosedError, ConfigError, AuthError, MetadataError (as `get`; also: no ETag).
        """
        found = self._get(key)
        return None if found is None else Versioned(found.content, self._revision_of(found, "GET", key))

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key` on the server; ends its ephemerality (mutates remote state).

        Raises:
            ClosedError, ConfigError (invalid key, oversized value), AuthError (the server
            refused the signature), MetadataError (network, 5xx).
        """
        check_value(value)
        response = self._request("PUT", key, bytes(value))
        self._expect(response, "PUT", key, ok=(200, 201, 204))
        self._forget(key)

    def delete(self, key: str) -> None:
        """Remove `key` on the server; a missing key (404) is fine (mutates remote state).

        Raises:
            ClosedError, ConfigError (invalid key), AuthError (the server refused the signature),
            MetadataError (network, 5xx).
        """
        response = self._request("DELETE", key)
        self._expect(response, "DELETE", key, ok=(200, 202, 204, 404))
        self._forget(key)

    def compare_and_set(self, key: str, value: bytes, expected_revision: int) -> int:
        """PUT with If-Match (If-None-Match: * for 0); the new revision (mutates remote state).

        Raises:
            ClosedError, ConfigError (invalid key, value or revision), AuthError,
            RevisionConflict (412), MetadataError (network, 5xx, no ETag).
        """
        check_value(value)
        check_revision(expected_revision, allow_zero=True)
        condition = {"If-None-Match": "*"} if expected_revision == 0 else {"If-Match": etag(expected_revision)}
        response = self._request("PUT", key, bytes(value), headers=condition)
        self._expect(response, "PUT", key, ok=(200, 201, 204))
        self._forget(key)
        return self._revision_of(response, "PUT", key)

    def compare_and_delete(self, key: str, expected_revision: int) -> None:
        """DELETE with If-Match (mutates remote state).

        Raises:
            ClosedError, ConfigError (invalid key or revision), AuthError, RevisionConflict
            (412: another revision, or no key), MetadataError (network, 5xx).
        """
        check_revision(expected_revision, allow_zero=False)
        response = self._request("DELETE", key, headers={"If-Match": etag(expected_revision)})
        self._expect(response, "DELETE", key, ok=(200, 202, 204))
        self._forget(key)

    def list_prefix(self, prefix: str) -> dict[str, Versioned]:
        """Every key starting with `prefix`, with values and revisions (GET /metadata/list).

        Raises:
            ClosedError, ConfigError (invalid prefix), AuthError, MetadataError (network,
            5xx: more than MAX_LIST_KEYS keys; a malformed answer).
        """
        check_prefix(prefix)
        response = self._send("GET", self._list_url, {"prefix": prefix}, f"list {prefix!r}")
        self._expect(response, "GET", f"list {prefix!r}", ok=(200,))
        try:
            listing = msgspec.msgpack.decode(response.content, type=_Listing)
        except msgspec.DecodeError as exc:  # ValidationError too
            raise MetadataError(f"metadata server {self.url} sent a malformed listing: {exc}") from exc
        return {key: Versioned(value, revision) for key, (value, revision) in listing.items()}

    def put_ephemeral(self, key: str, value: bytes, ttl_s: float) -> None:
        """PUT with ttl_s: the server drops the key `ttl_s` after the last such PUT (mutates).

        Raises:
            ClosedError, ConfigError (invalid key, value or ttl), AuthError, MetadataError.
        """
        check_value(value)
        check_ttl(ttl_s)
        response = self._request("PUT", key, bytes(value), ttl_s=repr(float(ttl_s)))
        self._expect(response, "PUT", key, ok=(200, 201, 204))
        revision = parse_etag(response.headers.get("etag", ""))
        with self._lock:
            if revision is None:
                self._ephemeral.pop(key, None)
            else:
                self._ephemeral[key] = revision

    def close(self) -> None:
        """Withdraw the ephemeral keys this handle still owns (best effort: an unreachable
        server times them out), then close the connection pool; idempotent."""
        with self._lock:
            owned, self._ephemeral = self._ephemeral, {}
        for key, revision in owned.items():
            try:
                self.compare_and_delete(key, revision)
            except (RevisionConflict, ConfigError, AuthError):
                continue  # NOTE: rewritten since by someone else: theirs now
            except (MetadataError, ClosedError):
                break  # NOTE: the server is gone (or we are): their TTLs end them
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> HttpMetadata:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _forget(self, key: str) -> None:
        with self._lock:
            self._ephemeral.pop(key, None)

    def _get(self, key: str) -> httpx.Response | None:
        response = self._request("GET", key)
        if response.status_code == 404:
            return None
        self._expect(response, "GET", key, ok=(200,))
        return response

    def _request(
        self, method: str, key: str, content: bytes | None = None, headers: dict[str, str] | None = None, **params: str
    ) -> httpx.Response:
        check_key(key)
        return self._send(method, self.url, {"key": key, **params}, repr(key), content, headers)

    def _send(
        self,
        method: str,
        url: str,
        params: dict[str, str],
        what: str,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        if self._closed:
            raise ClosedError("HttpMetadata client is closed")
        try:
            request = self._client.build_request(method, url, params=params, content=content, headers=headers)
            return self._client.send(httpd.sign_request(request, self._secret))
        except httpx.TimeoutException as exc:
            raise MetadataError(f"metadata server {self.url} timed out on {method} {what}") from exc
        except httpx.HTTPError as exc:
            raise MetadataError(f"metadata server {self.url} failed on {method} {what}: {exc!r}") from exc

    def _revision_of(self, response: httpx.Response, method: str, key: str) -> int:
        revision = parse_etag(response.headers.get("etag", ""))
        if revision is None:
            raise MetadataError(f"metadata server {self.url} sent no revision (ETag) for {method} {key!r}")
        return revision

    def _expect(self, response: httpx.Response, method: str, what: str, ok: tuple[int, ...]) -> None:
        status = response.status_code
        if status in ok:
            return
        try:
            body = response.json()
        except ValueError:
            body = None
        detail = str(body["detail"]) if isinstance(body, dict) and "detail" in body else response.text[:200]
        message = f"metadata server {self.url} answered {status} to {method} {what}: {detail}"
        if status == 401:
            raise AuthError(message)
        if status == 412:
            raise RevisionConflict(message)
        if status in _CALLER_FAULT_STATUSES:
            raise ConfigError(message)
        raise MetadataError(message)
