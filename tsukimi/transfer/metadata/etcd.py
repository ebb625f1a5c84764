"""Metadata in a real etcd cluster, through etcd3gw (etcd's grpc-gateway JSON API).

`EtcdMetadata.from_url("etcd://h1:p1,h2:p2")` keeps one etcd3gw client per endpoint and sends
each call to the endpoint that last worked, failing over to the next one in URL order when a
connection fails, times out or answers 503 (`EtcdEndpoints`, tsukimi/transfer/metadata/etcd_kv.py).
Other errors are not retried.

Revisions are etcd's: a key's `mod_revision`. `compare_and_set` and `compare_and_delete` are
one transaction each (compare MOD == expected, or CREATE == 0 for "absent"; then put/delete).

Ephemeral keys ride on leases, one per key and handle: the first `put_ephemeral` of a key
grants a lease of ceil(ttl_s) seconds (at least 1; etcd itself raises it to its minimum,
1.5 election timeouts: 2 s with etcd's defaults) and puts the key with it; later calls keep
the lease alive and re-put only when the key no longer holds that value on that lease (the
value changed, or someone put or deleted it since). A lease found expired is replaced by a new
one. A plain put, delete or compare-and-set of the key detaches it from the lease (etcd's
own rule for a put without a lease), and this handle forgets the lease (left to expire with no
key). `close()` revokes the leases this handle holds, deleting the keys still attached.

Keys travel as UTF-8 bytes and values as bytes; etcd3gw base64-encodes both for the JSON API,
so arbitrary bytes round-trip. (Given a `str`, etcd3gw encodes it as latin-1, which fails for
most unicode: never hand it a `str`.)
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence

from tsukimi.errors import ClosedError, MetadataError, RevisionConflict
from tsukimi.transfer.metadata.base import (
    MAX_LIST_KEYS,
    Versioned,
    check_key,
    check_prefix,
    check_revision,
    check_ttl,
    check_value,
)
from tsukimi.transfer.metadata.etcd_kv import (
    Endpoint,
    EtcdEndpoints,
    EtcdKV,
    created_at,
    delete_op,
    holds,
    leased_by,
    modified_at,
    parse_etcd_url,
    prefix_end,
    put_op,
)

logger = logging.getLogger(__name__)


def lease_ttl_s(ttl_s: float) -> int:
    """The lease TTL asked of etcd for `ttl_s`: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(ttl_s))


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
        self._kv = EtcdKV(self._etcd)
        self.endpoints = self._etcd.endpoints
        # NOTE: one lock for the lease table, held across put_ephemeral's calls so that two
        # threads refreshing one key never grant two leases.
        self._lease_lock = threading.Lock()
        self._leases: dict[bytes, tuple[int, int]] = {}  # key -> (lease id, lease TTL s)

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
        """Store `value` under `key`; ends its ephemerality (mutates the cluster).

        Raises:
            ClosedError, ConfigError (invalid key or value), MetadataError (etcd refused it, for
            instance a value over its --max-request-bytes, 1.5 MiB by default; or every
            endpoint failed).
        """
        raw_key = check_key(key)
        check_value(value)
        data = bytes(value)
        self._etcd.call(f"put {key!r}", lambda client: client.put(raw_key, data))
        self._forget_lease(raw_key)

    def delete(self, key: str) -> None:
        """Remove `key`; a missing key is fine (mutates the cluster).

        Raises:
            ClosedError, ConfigError (invalid key), MetadataError (every endpoint failed).
        """
        raw_key = check_key(key)
        self._etcd.call(f"delete {key!r}", lambda client: client.delete(raw_key))
        self._forget_lease(raw_key)

    def get_versioned(self, key: str) -> Versioned | None:
        """The value under `key` with its mod_revision, or None.

        Raises:
            ClosedError, ConfigError (invalid key), MetadataError (every endpoint failed).
        """
        found = self._kv.record(check_key(key))
        return None if found is None else Versioned(found.value, found.mod_revision)

    def compare_and_set(self, key: str, value: bytes, expected_revision: int) -> int:
        """Store `value` if `key` is at `expected_revision` (0: absent), in one transaction;
        returns the new mod_revision (mutates the cluster).

        Raises:
            ClosedError, ConfigError (invalid key, value or revision), RevisionConflict,
            MetadataError (etcd refused it, or every endpoint failed).
        """
        raw_key = check_key(key)
        check_value(value)
        check_revision(expected_revision, allow_zero=True)
        guard = created_at(raw_key, 0) if expected_revision == 0 else modified_at(raw_key, expected_revision)
        result = self._kv.txn([guard], [put_op(raw_key, bytes(value))])
        if not result.succeeded:
            raise RevisionConflict(f"metadata key {key!r} is no longer at revision {expected_revision}")
        self._forget_lease(raw_key)
        return result.revision

    def compare_and_delete(self, key: str, expected_revision: int) -> None:
        """Remove `key` if it is at `expected_revision`, in one transaction (mutates).

        Raises:
            ClosedError, ConfigError (invalid key or revision), RevisionConflict (another
            revision, or no key), MetadataError (every endpoint failed).
        """
        raw_key = check_key(key)
        check_revision(expected_revision, allow_zero=False)
        if not self._kv.txn([modified_at(raw_key, expected_revision)], [delete_op(raw_key)]).succeeded:
            raise RevisionConflict(f"metadata key {key!r} is no longer at revision {expected_revision}")
        self._forget_lease(raw_key)

    def list_prefix(self, prefix: str) -> dict[str, Versioned]:
        """Every key starting with `prefix`, with values and mod_revisions, read at one
        revision. Keys that are not UTF-8 (written by another client) are skipped.

        Raises:
            ClosedError, ConfigError (invalid prefix), MetadataError (over MAX_LIST_KEYS keys,
            or every endpoint failed).
        """
        raw_prefix = check_prefix(prefix)
        records = self._kv.scan(raw_prefix, prefix_end(raw_prefix), max_records=MAX_LIST_KEYS)
        if len(records) > MAX_LIST_KEYS:
            raise MetadataError(f"more than {MAX_LIST_KEYS} keys start with {prefix!r}")
        found: dict[str, Versioned] = {}
        for record in records:
            try:
                found[record.key.decode()] = Versioned(record.value, record.mod_revision)
            except UnicodeDecodeError:
                logger.warning("skipping etcd key %r under %r: not UTF-8", record.key, prefix)
        return found

    def put_ephemeral(self, key: str, value: bytes, ttl_s: float) -> None:
        """Store `value` under `key` on a lease of `lease_ttl_s(ttl_s)` seconds this handle
        keeps; a later call refreshes it (see the module docstring). Mutates the cluster.

        Raises:
            ClosedError, ConfigError (invalid key, value or ttl), MetadataError (every
            endpoint failed).
        """
        raw_key = check_key(key)
        check_value(value)
        check_ttl(ttl_s)
        data, ttl = bytes(value), lease_ttl_s(ttl_s)
        with self._lease_lock:
            lease, granted_ttl = self._leases.get(raw_key, (0, 0))
            if lease and granted_ttl == ttl and self._kv.keepalive(lease) > 0:
                # NOTE: re-put only when the key lost this value or this lease since.
                self._kv.txn([leased_by(raw_key, lease), holds(raw_key, data)], [], [put_op(raw_key, data, lease)])
                return
            fresh = self._kv.grant(ttl)
            self._kv.txn([], [put_op(raw_key, data, fresh)])
            self._leases[raw_key] = (fresh, ttl)
        if lease and granted_ttl != ttl:  # the key moved to a lease of the new TTL: the old one goes
            self._revoke(lease)

    def close(self) -> None:
        """Revoke this handle's leases (their keys go now), then close every endpoint's HTTP
        session; idempotent."""
        with self._lease_lock:
            leases, self._leases = [lease for lease, _ in self._leases.values()], {}
        for lease in leases:
            self._revoke(lease)
        self._etcd.close()

    def __enter__(self) -> EtcdMetadata:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdMetadata(etcd://{','.join(f'{h}:{p}' for h, p in self.endpoints)})"

    def _forget_lease(self, raw_key: bytes) -> None:
        # NOTE: not revoked: the key left it with the write that called this; it expires alone.
        with self._lease_lock:
            self._leases.pop(raw_key, None)

    def _revoke(self, lease: int) -> None:
        try:
            self._kv.revoke(lease)
        except (MetadataError, ClosedError) as exc:
            # NOTE: an expired lease is "not found"; an unreachable etcd expires it by itself.
            logger.debug("could not revoke etcd lease %x: %s", lease, exc)
