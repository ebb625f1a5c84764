"""The etcd calls the HA master needs: leases, guarded transactions, ranges (etcd3gw's JSON API).

Endpoint failover is `EtcdEndpoints`' (shared with the metadata backend). Every call is bounded
by `timeout_s` per endpoint. Keys and values are bytes (base64 on the wire).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from tsukimi.transfer.metadata.etcd import EtcdEndpoints, parse_etcd_url

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
    """Thread-safe. Raises MetadataError when no endpoint answers or etcd refuses a call
    (endpoint failover: `EtcdEndpoints`)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self._etcd = EtcdEndpoints(parse_etcd_url(url), timeout_s)

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
        self._etcd.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._etcd.call(path, lambda client: client.post(client.get_url(path), json=body))
