"""Metadata in a real etcd cluster, through etcd3gw (etcd's grpc-gateway JSON API).

`EtcdMetadata.from_url("etcd://h1:p1,h2:p2")` keeps one etcd3gw client per endpoint and sends
each call to the endpoint that last worked, failing over to the next one in URL order when a
connection fails, times out or answers 503. Other errors are not retried.

Keys travel as UTF-8 bytes and values as bytes; etcd3gw base64-encodes both for the JSON API,
so arbitrary bytes round-trip. (Given a `str`, etcd3gw encodes it as latin-1, which fails for
most unicode: never hand it a `str`.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

from tsukimi.errors import ClosedError, ConfigError, MetadataError
from tsukimi.transfer.metadata.base import check_key, check_value

logger = logging.getLogger(__name__)

DEFAULT_ETCD_PORT = 2379
# NOTE: etcd >= 3.4 serves the gateway at /v3/ (3.3: /v3beta/, 3.2: /v3alpha/, gone in 3.4).
# Naming it saves etcd3gw's /version discovery round trip and ignores ETCD3GW_API_PATH.
ETCD_API_PATH = "/v3/"

_T = TypeVar("_T")
Endpoint = tuple[str, int]


def parse_etcd_url(url: str) -> list[Endpoint]:
    """The (host, port) endpoints of `etcd://host:port[,host:port...]`, in order.

    A missing port means 2379; IPv6 hosts are written in brackets (`[::1]:2379`).

    Raises:
        ConfigError: not an etcd:// URL, or a malformed endpoint.
    """
    if not url.startswith("etcd://"):
        raise ConfigError(f"etcd metadata URL must start with etcd://, got {url!r}")
    endpoints = [_parse_endpoint(part.strip(), url) for part in url.removeprefix("etcd://").split(",")]
    return endpoints


def _parse_endpoint(text: str, url: str) -> Endpoint:
    text = text.rstrip("/")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(f"malformed IPv6 endpoint {text!r} in {url!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"empty host in etcd URL {url!r}")
    if not port_text:
        return host, DEFAULT_ETCD_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"bad port {port_text!r} in etcd URL {url!r}; expected 1..65535")
    return host, int(port_text)


class EtcdEndpoints:
    """One etcd3gw client per endpoint, tried in order: a call goes to the endpoint that last
    worked and fails over to the next when a connection fails or times out (thread-safe).
    Shared by the metadata backend and the HA master's etcd calls (metadata/etcd_kv.py).

    Raises (constructor): ConfigError: no endpoints or a non-positive timeout.
    """

    def __init__(self, endpoints: Sequence[Endpoint], timeout_s: float) -> None:
        if not endpoints:
            raise ConfigError("an etcd client needs at least one endpoint")
        if timeout_s <= 0:
            raise ConfigError(f"etcd timeout_s must be > 0, got {timeout_s}")
        self.endpoints = list(endpoints)
        self.clients = [self._make_client(host, port, timeout_s) for host, port in self.endpoints]
        self._lock = threading.Lock()
        self._current = 0
        self._closed = False

    @staticmethod
    def _make_client(host: str, port: int, timeout_s: float) -> Etcd3Client:
        session = requests.Session()
        # NOTE: an HTTP(S)_PROXY in the environment must not capture cluster-internal traffic.
        session.trust_env = False
        return Etcd3Client(host=host, port=port, timeout=timeout_s, api_path=ETCD_API_PATH, session=session)

    def call(self, what: str, fn: Callable[[Etcd3Client], _T]) -> _T:
        """Run `fn` on the current endpoint, failing over in order on connection trouble.

        Raises:
            ClosedError: closed.
            MetadataError: etcd refused the call, answered something malformed, or no
                endpoint answered (`what` names the call in the message).
        """
        with self._lock:
            if self._closed:
                raise ClosedError("the etcd client is closed")
            start = self._current
        last_error: Etcd3Exception | None = None
        for step in range(len(self.clients)):
            index = (start + step) % len(self.clients)
            try:
                result = fn(self.clients[index])
            except (ConnectionFailedError, ConnectionTimeoutError) as exc:
                logger.debug("etcd %s:%d failed on %s: %s", *self.endpoints[index], what, _describe(exc))
                last_error = exc
                continue
            except Etcd3Exception as exc:
                raise MetadataError(f"etcd refused {what}: {_describe(exc)}") from exc
            except (requests.RequestException, ValueError, KeyError, TypeError, AttributeError) as exc:
                # NOTE: etcd3gw indexes the JSON answer as it comes: a body of another shape
                # (null, a list, a string of kvs) raises TypeError / AttributeError (found by tests/fuzz)
                raise MetadataError(f"etcd answered {what} unexpectedly: {exc!r}") from exc
            if index != start:
                logger.info("etcd client failed over to %s:%d", *self.endpoints[index])
                with self._lock:
                    self._current = index
            return result
        assert last_error is not None
        raise MetadataError(f"no etcd endpoint answered {what} ({self}): {_describe(last_error)}") from last_error

    def close(self) -> None:
        """Close every endpoint's HTTP session; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for client in self.clients:
            client.session.close()

    def __str__(self) -> str:
        return ", ".join(f"{host}:{port}" for host, port in self.endpoints)


class EtcdMetadata:
    """A `MetadataBackend` over etcd with client-side failover (thread-safe).

    Args:
        endpoints: (host, port) pairs, tried in order.
        timeout_s: timeout of each HTTP request; a call may take up to one timeout per endpoint.
    Raises:
        ConfigError: no endpoints or a non-positive timeout.
    """

    def __init__(self, endpoints: Sequence[Endpoint], timeout_s: float = 5.0) -> None:
        self._etcd = EtcdEndpoints(endpoints, timeout_s)
        self.endpoints = self._etcd.endpoints

    @classmethod
    def from_url(cls, url: str, timeout_s: float = 5.0) -> EtcdMetadata:
        """Connect (lazily) to the endpoints of `etcd://host:port[,host:port...]`.

        Raises:
            ConfigError: malformed URL.
        """
        return cls(parse_etcd_url(url), timeout_s=timeout_s)

    def get(self, key: str) -> bytes | None:
        """The value under `key`, or None.

        Raises:
            ClosedError, ConfigError (invalid key), MetadataError (every endpoint failed).
        """
        raw_key = check_key(key)
        values = self._etcd.call(f"get {key!r}", lambda client: client.get(raw_key))
        return values[0] if values else None

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key` (mutates the cluster).

        Raises:
            ClosedError, ConfigError (invalid key or value), MetadataError (etcd refused it, for
            instance a value over its --max-request-bytes, 1.5 MiB by default; or every
            endpoint failed).
        """
        raw_key = check_key(key)
        check_value(value)
        data = bytes(value)
        self._etcd.call(f"put {key!r}", lambda client: client.put(raw_key, data))

    def delete(self, key: str) -> None:
        """Remove `key`; a missing key is fine (mutates the cluster).

        Raises:
            ClosedError, ConfigError (invalid key), MetadataError (every endpoint failed).
        """
        raw_key = check_key(key)
        self._etcd.call(f"delete {key!r}", lambda client: client.delete(raw_key))

    def close(self) -> None:
        """Close every endpoint's HTTP session; idempotent."""
        self._etcd.close()

    def __enter__(self) -> EtcdMetadata:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdMetadata(etcd://{','.join(f'{h}:{p}' for h, p in self.endpoints)})"


def _describe(exc: Etcd3Exception) -> str:
    # NOTE: etcd3gw keeps the response body in `detail_text`; str(exc) is often just the reason.
    return " ".join(part for part in (str(exc), exc.detail_text or "") if part) or type(exc).__name__
