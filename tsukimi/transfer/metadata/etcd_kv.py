"""The etcd client: endpoints with failover (`EtcdEndpoints`) and the calls beyond
get/put/delete (`EtcdKV`): leases, guarded transactions, ranges with revisions, over etcd3gw's
JSON API (etcd's grpc-gateway). Used by the metadata backend (`EtcdMetadata`: compare-and-set,
ephemeral keys, listing) and the HA master (store/ha: election, fenced log).

Every call is bounded by `timeout_s` per endpoint. Keys and values are bytes (base64 on the
wire).
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

from tsukimi.errors import ClosedError, ConfigError, MetadataError

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
    Shared by the metadata backend and the HA master (through `EtcdKV`).

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


Op = dict[str, Any]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix` (b"\\0": every key, for a
    prefix of 0xff bytes only)."""
    stem = prefix.rstrip(b"\xff")
    if not stem:
        return b"\0"
    return stem[:-1] + bytes([stem[-1] + 1])


def put_op(key: bytes, value: bytes, lease: int = 0) -> Op:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def delete_op(key: bytes, range_end: bytes | None = None) -> Op:
    body = {"key": _b64(key)}
    if range_end is not None:
        body["range_end"] = _b64(range_end)
    return {"request_delete_range": body}


def created_at(key: bytes, revision: int) -> Op:
    """Compare: `key` was created at `revision` (0: the key does not exist)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(revision)}


def modified_at(key: bytes, revision: int) -> Op:
    """Compare: `key` was last written at `revision` (a missing key compares as 0)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}


def leased_by(key: bytes, lease: int) -> Op:
    """Compare: `key` is attached to `lease` (a missing key compares as lease 0)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": str(lease)}


def holds(key: bytes, value: bytes) -> Op:
    """Compare: `key` exists and holds `value`."""
    return {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key as etcd keeps it: create_revision is fixed until the key is deleted,
    mod_revision changes with every write."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int


def _record(kv: dict[str, Any]) -> KeyRecord:
    value = base64.b64decode(kv.get("value", ""))
    return KeyRecord(base64.b64decode(kv["key"]), value, int(kv["create_revision"]), int(kv["mod_revision"]))


class EtcdKV:
    """Thread-safe. Raises MetadataError when no endpoint answers, etcd refuses a call or
    answers something malformed (endpoint failover: `EtcdEndpoints`, given or made from an
    etcd:// URL)."""

    def __init__(self, url: str | EtcdEndpoints, timeout_s: float = 2.0) -> None:
        self._etcd = EtcdEndpoints(parse_etcd_url(url), timeout_s) if isinstance(url, str) else url

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds (etcd may raise it to its minimum); returns its id."""
        return self._post("/lease/grant", {"TTL": ttl_s, "ID": 0}, lambda result: int(result["ID"]))

    def keepalive(self, lease: int) -> int:
        """Refresh a lease; returns its new TTL, or -1 if it had expired."""
        return self._post("/lease/keepalive", {"ID": str(lease)}, lambda r: int(r.get("result", {}).get("TTL", -1)))

    def revoke(self, lease: int) -> None:
        """End a lease now, deleting its keys (an expired lease: MetadataError, not found)."""
        self._post("/kv/lease/revoke", {"ID": str(lease)}, lambda _: None)

    def get(self, key: bytes) -> tuple[bytes, int] | None:
        """(value, create_revision) of `key`, or None."""
        found = self.record(key)
        return None if found is None else (found.value, found.create_revision)

    def record(self, key: bytes) -> KeyRecord | None:
        """`key` with its revisions, or None."""
        records, _, _ = self._post("/kv/range", {"key": _b64(key)}, _range_page)
        return records[0] if records else None

    def range(self, start: bytes, end: bytes, limit: int = 256) -> list[tuple[bytes, bytes]]:
        """Every (key, value) in [start, end), in key order (paged by `limit`)."""
        return [(found.key, found.value) for found in self.scan(start, end, limit)]

    def scan(self, start: bytes, end: bytes, limit: int = 256, max_records: int | None = None) -> list[KeyRecord]:
        """Every key in [start, end) with its revisions, in key order, as of one revision
        (paged by `limit`; stops once it holds more than `max_records`)."""
        out: list[KeyRecord] = []
        body: dict[str, Any] = {"range_end": _b64(end), "limit": limit, "sort_order": 1, "sort_target": 0}
        while True:
            records, more, revision = self._post("/kv/range", {**body, "key": _b64(start)}, _range_page)
            out.extend(records)
            if not more or not records or (max_records is not None and len(out) > max_records):
                return out
            body["revision"] = str(revision)  # NOTE: every page from one snapshot
            start = out[-1].key + b"\0"

    def txn(self, compare: list[Op], success: list[Op], failure: list[Op] | None = None) -> TxnResult:
        """Apply `success` if every comparison holds, else `failure`, atomically. The
        result's revision is the store's after the transaction (a key put by it has that
        mod_revision)."""
        body = {"compare": compare, "success": success, "failure": failure or []}
        return self._post("/kv/txn", body, lambda r: TxnResult(bool(r.get("succeeded", False)), _revision(r)))

    def close(self) -> None:
        self._etcd.close()

    def _post(self, path: str, body: dict[str, Any], parse: Callable[[Any], _T]) -> _T:
        # NOTE: parsed inside `call`, so that an answer of another shape is a MetadataError too.
        return self._etcd.call(path, lambda client: parse(client.post(client.get_url(path), json=body)))


def _revision(result: dict[str, Any]) -> int:
    return int(result["header"]["revision"])


def _range_page(result: dict[str, Any]) -> tuple[list[KeyRecord], bool, int]:
    """A /kv/range answer: its records, whether more follow, the store's revision."""
    return [_record(kv) for kv in result.get("kvs", [])], bool(result.get("more")), _revision(result)


def _describe(exc: Etcd3Exception) -> str:
    # NOTE: etcd3gw keeps the response body in `detail_text`; str(exc) is often just the reason.
    return " ".join(part for part in (str(exc), exc.detail_text or "") if part) or type(exc).__name__
