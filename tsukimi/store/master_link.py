"""`MasterLink`: a store client's calls to the master, following the leader of an HA group.

Given `tcp://HOST:PORT`, calls go to that master and are not retried (a lone master). Given
`etcd://HOST:PORT[,...]`, the link reads the leader's address from etcd (the key the elected
master keeps alive, tsukimi/store/ha/leader.py) and, when a call fails because there is no
leader, the leader changed or the connection broke, finds the leader again and retries, for
up to `client.failover_timeout_s` in all; then it raises MasterUnavailable.

Retrying is safe because every store operation is idempotent under retry: reads and
heartbeats trivially; a mount of the same segment is a no-op; PutStart carries a put id the
client chose, so a retried one returns the same put; PutEnd of a put that already ended is a
no-op; a retried PutRevoke, Unmount or Remove that had been applied answers ObjectNotFound.
"""

from __future__ import annotations

import logging
import threading
from typing import TypeVar

import msgspec

from tsukimi.clock import WallClock
from tsukimi.config import ClientConfig
from tsukimi.errors import (
    BrokenConnectionError,
    ClosedError,
    MasterUnavailable,
    MetadataError,
    NotLeader,
    ProtocolError,
    RpcTimeout,
)
from tsukimi.retry import Attempts, Retry
from tsukimi.rpc import NO_RETRY, UNSENT_RETRY, Codec, RpcClient
from tsukimi.store.leader_record import LeaderInfo, leader_key
from tsukimi.transfer.metadata.etcd_kv import EtcdKV

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)
# NOTE: one attempt on one master waits at most this long, so a paused leader (SIGSTOP, a
# partition) costs a client this much before it looks for a new one; a slower answer is
# simply asked again (every operation is idempotent under retry).
ATTEMPT_S = 1.0
# NOTE: ClosedError: another thread of this client found the leader gone and closed its connection
RETRIABLE = (NotLeader, RpcTimeout, BrokenConnectionError, ClosedError)
_BACKOFF_S = 0.05


class MasterLink:
    """Thread-safe; `close()` when done. Connects lazily."""

    def __init__(self, config: ClientConfig, codec: Codec, secret: bytes | None = None) -> None:
        self.config = config
        self._codec = codec
        self._secret = secret
        self._clock = WallClock()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._rpc: RpcClient | None = None
        self._kv: EtcdKV | None = None
        # NOTE: MetadataError, ProtocolError: etcd failed, or held a malformed leader record
        self._retry = Retry(None, config.failover_timeout_s, _BACKOFF_S, on=(*RETRIABLE, MetadataError, ProtocolError))
        if config.master.startswith("etcd://"):
            self._kv = EtcdKV(config.master, timeout_s=min(2.0, config.rpc_timeout_s))
            self._key = leader_key(config.ha_cluster)
        else:
            self._rpc = self._client(config.master)

    def call(self, request: msgspec.Struct, attempt_s: float = ATTEMPT_S) -> msgspec.Struct:
        """Send `request` to the master (the leader) and return its response.

        Raises:
            MasterUnavailable: (HA) no leader answered within failover_timeout_s.
            and what RpcClient.call raises (a lone master's errors are not retried).
        """
        if self._kv is None:
            assert self._rpc is not None
            return self._rpc.call(request)
        attempts = self._retry.start(self._clock)
        while True:
            rpc = self._leader(attempts)
            try:
                timeout_s = min(self.config.rpc_timeout_s, attempt_s, attempts.remaining_s())
                return rpc.call(request, timeout_s=max(0.05, timeout_s))
            except RETRIABLE as exc:
                self._forget(rpc)
                if not attempts.wait(exc, self._closed):
                    raise MasterUnavailable(
                        f"{type(request).__name__}: no master leader answered within "
                        f"{self.config.failover_timeout_s} s: {exc}"
                    ) from exc
                logger.info("master %s failed (%s); finding the leader again", rpc.endpoint, exc)

    def call_as(self, request: msgspec.Struct, response_type: type[T], attempt_s: float = ATTEMPT_S) -> T:
        """`call`, then check the response type. Raises ProtocolError on another type."""
        reply = self.call(request, attempt_s)
        if not isinstance(reply, response_type):
            raise ProtocolError(
                f"{type(request).__name__}: expected {response_type.__name__}, got {type(reply).__name__}"
            )
        return reply

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            rpc, self._rpc = self._rpc, None
        if rpc is not None:
            rpc.close()
        if self._kv is not None:
            self._kv.close()

    def _client(self, endpoint: str, leader: bool = False) -> RpcClient:
        """An RPC client; a leader's fails at once when unreachable (the link looks again)."""
        spin_s = self.config.rpc_spin_us * 1e-6
        retry = NO_RETRY if leader else UNSENT_RETRY
        return RpcClient(self._codec, endpoint, self.config.rpc_timeout_s, spin_s, secret=self._secret, retry=retry)

    def _leader(self, attempts: Attempts) -> RpcClient:
        """The RPC client of the current leader, looked up in etcd if not known."""
        assert self._kv is not None
        while True:
            with self._lock:
                if self._rpc is not None:
                    return self._rpc
            if self._closed.is_set():
                raise MasterUnavailable("the store client is closed")
            try:
                found = self._kv.get(self._key)
                if found is None:
                    raise NotLeader("no leader is elected")
                info = LeaderInfo.decode(found[0])
            except (MetadataError, NotLeader, ProtocolError) as exc:
                if not attempts.wait(exc if not isinstance(exc, ProtocolError) else None, self._closed):
                    raise MasterUnavailable(
                        f"no master leader within {self.config.failover_timeout_s} s: {exc}"
                    ) from exc
                continue
            with self._lock:
                if self._rpc is None:
                    self._rpc = self._client(info.rpc, leader=True)
                return self._rpc

    def _forget(self, rpc: RpcClient) -> None:
        with self._lock:
            if self._rpc is rpc:
                self._rpc = None
        rpc.close()
