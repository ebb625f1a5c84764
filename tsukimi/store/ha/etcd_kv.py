"""The etcd calls the HA master needs: leases, guarded transactions, ranges (etcd3gw's JSON API).

One etcd3gw client per endpoint; a call goes to the endpoint that last worked and fails over
in URL order when a connection fails or times out. Every call is bounded by `timeout_s` per
endpoint. Keys and values are bytes (base64 on the wire).
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

from tsukimi.errors import MetadataError
from tsukimi.transfer.metadata.etcd import ETCD_API_PATH, parse_etcd_url

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
Op = dict[str, Any]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


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


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int


class EtcdKV:
    """Thread-safe. Raises MetadataError when no endpoint answers or etcd refuses a call."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.endpoints = parse_etcd_url(url)
        self._clients = []
        for host, port in self.endpoints:
            session = requests.Session()
            session.trust_env = False  # NOTE: a proxy in the environment must not capture cluster traffic
            self._clients.append(
                Etcd3Client(host=host, port=port, timeout=timeout_s, api_path=ETCD_API_PATH, session=session)
            )
        self._lock = threading.Lock()
        self._current = 0

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; returns its id."""
        result = self._post("/lease/grant", {"TTL": ttl_s, "ID": 0})
        return int(result["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh a lease; returns its new TTL, or -1 if it had expired."""
        result = self._post("/lease/keepalive", {"ID": str(lease)})
        return int(result.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """End a lease now, deleting its keys."""
        self._post("/kv/lease/revoke", {"ID": str(lease)})

    def get(self, key: bytes) -> tuple[bytes, int] | None:
        """(value, create_revision) of `key`, or None."""
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        if not kvs:
            return None
        return base64.b64decode(kvs[0].get("value", "")), int(kvs[0]["create_revision"])

    def range(self, start: bytes, end: bytes, limit: int = 256) -> list[tuple[bytes, bytes]]:
        """Every (key, value) in [start, end), in key order (paged by `limit`)."""
        out: list[tuple[bytes, bytes]] = []
        while True:
            body = {"key": _b64(start), "range_end": _b64(end), "limit": limit, "sort_order": 1, "sort_target": 0}
            result = self._post("/kv/range", body)
            kvs = result.get("kvs", [])
            out.extend((base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", ""))) for kv in kvs)
            if not result.get("more") or not kvs:
                return out
            start = out[-1][0] + b"\0"

    def txn(self, compare: list[Op], success: list[Op], failure: list[Op] | None = None) -> TxnResult:
        """Apply `success` if every comparison holds, else `failure`, atomically."""
        result = self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        return TxnResult(bool(result.get("succeeded", False)), int(result["header"]["revision"]))

    def close(self) -> None:
        for client in self._clients:
            client.session.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(path, lambda client: client.post(client.get_url(path), json=body))

    def _call(self, what: str, fn: Callable[[Etcd3Client], _T]) -> _T:
        with self._lock:
            start = self._current
        last: Exception | None = None
        for step in range(len(self._clients)):
            index = (start + step) % len(self._clients)
            try:
                result = fn(self._clients[index])
            except (ConnectionFailedError, ConnectionTimeoutError) as exc:
                last = exc
                continue
            except Etcd3Exception as exc:
                raise MetadataError(f"etcd refused {what}: {exc} {exc.detail_text or ''}") from exc
            except (requests.RequestException, ValueError, KeyError) as exc:
                raise MetadataError(f"etcd answered {what} unexpectedly: {exc!r}") from exc
            if index != start:
                with self._lock:
                    self._current = index
            return result
        raise MetadataError(f"no etcd endpoint answered {what}: {last}") from last
