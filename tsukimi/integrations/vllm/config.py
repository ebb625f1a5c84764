"""`TsukimiConnectorConfig`: the connector's settings, read from vLLM's
`kv_connector_extra_config`, and `PoolLink`, the connector's guarded handle on the store.

Keys of `kv_connector_extra_config` (all optional; unknown keys are a ConfigError):

    master          the store master's RPC endpoint          "tcp://127.0.0.1:50051"
    metadata        Transfer Engine metadata ("p2p", "http://HOST:PORT/metadata", "etcd://...")
    transport       "auto", "shm", "cma" or "tcp" (auto: shm/CMA on one host, else TCP)
    segment_bytes   memory this instance adds to the pool (0: a pure client)
    rpc_timeout_s   deadline of every master call and side-channel call            1.0
    retry_s         after the master failed, plain vLLM for this long, then retry  5.0
    load_async      loads run between scheduler steps (get_finished)               true
    save_per_layer  put each layer from save_kv_layer while later layers compute   true
    checksum        crc32c every object; a corrupt block is recomputed            false
    pd_mode         a producer's default PD hand-over: "pool" (it saves, the consumer
                    loads by hash) or "direct" (the consumer READs its KV buffer);
                    a request's kv_transfer_params "tsukimi_pd_mode" overrides it  "pool"
    pd_host, pd_port  the producer's side channel; direct mode needs it  "127.0.0.1", 0 = off
    pd_lease_s      how long a producer keeps a finished request's blocks for the
                    consumer before freeing them anyway                           30.0
    model_tag       names the model in the format digest (default: vLLM's model name)
    fault_load_delay_s  fault injection for tests: each load waits this long before it
                    reads, so a test can remove blocks between lookup and load      0.0
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Literal

from tsukimi.config import Config
from tsukimi.errors import ConfigError, TsukimiError
from tsukimi.store.client import StoreClient
from tsukimi.transfer import TransferEngine

logger = logging.getLogger(__name__)

PdMode = Literal["pool", "direct"]
PD_MODES = ("pool", "direct")


@dataclass(frozen=True, slots=True)
class TsukimiConnectorConfig:
    """The connector's settings (see the module docstring for each key)."""

    master: str = "tcp://127.0.0.1:50051"
    metadata: str = "p2p"
    transport: str = "auto"
    segment_bytes: int = 0
    rpc_timeout_s: float = 1.0
    retry_s: float = 5.0
    load_async: bool = True
    save_per_layer: bool = True
    checksum: bool = False
    pd_mode: PdMode = "pool"
    pd_host: str = "127.0.0.1"
    pd_port: int = 0
    pd_lease_s: float = 30.0
    model_tag: str = ""
    fault_load_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.pd_mode not in PD_MODES:
            raise ConfigError(f"pd_mode must be one of {', '.join(PD_MODES)}, got {self.pd_mode!r}")
        if self.rpc_timeout_s <= 0 or self.retry_s < 0 or self.pd_lease_s <= 0:
            raise ConfigError("rpc_timeout_s and pd_lease_s must be > 0, retry_s >= 0")
        if not 0 <= self.pd_port < 65536 or self.segment_bytes < 0:
            raise ConfigError(f"pd_port must be in [0, 65535] and segment_bytes >= 0, got {self.pd_port}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> TsukimiConnectorConfig:
        """Parse vLLM's `kv_connector_extra_config`. Raises ConfigError for an unknown key or
        a value of the wrong type."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; valid: {sorted(known)}")
        values: dict[str, object] = {}
        defaults = cls()
        for key, value in extra.items():
            default = getattr(defaults, key)
            kind = type(default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"kv_connector_extra_config[{key!r}] must be {kind.__name__}, got {value!r}")
            values[key] = value
        return cls(**values)  # type: ignore[arg-type]

    def tsukimi_config(self) -> Config:
        """The tsukimi Config of this connector's store client and Transfer Engine."""
        base = Config()
        return replace(
            base,
            client=replace(
                base.client,
                master=self.master,
                segment_bytes=self.segment_bytes,
                rpc_timeout_s=self.rpc_timeout_s,
                checksum=self.checksum,
                failover_timeout_s=self.rpc_timeout_s,
            ),
            transfer=replace(base.transfer, transport=self.transport, timeout_s=max(5.0, 5 * self.rpc_timeout_s)),
            metadata=replace(base.metadata, url=self.metadata, timeout_s=self.rpc_timeout_s),
        )


class _OncePerOutage(logging.Filter):
    """Lets one heartbeat-failure line of the store client through per `every_s` (a dead
    master would otherwise cost vLLM's log a line per heartbeat for as long as it is down)."""

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self._every_s = every_s
        self._last = -every_s

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("heartbeat to"):
            return True
        now = time.monotonic()
        if now - self._last < self._every_s:
            return False
        self._last = now
        return True


class PoolLink:
    """A StoreClient made on first use and remade after failures: while the master is down
    every call answers None for `retry_s`, so vLLM runs plain (one warning per outage).

    Thread-safe. `engine` is shared with the client (the worker registers its KV buffer there).
    """

    def __init__(self, config: TsukimiConnectorConfig, engine: TransferEngine | None = None) -> None:
        self._config = config
        self._engine = engine
        self._client: StoreClient | None = None
        self._down_until = 0.0
        self._outage = False
        self._lock = threading.Lock()
        client_logger = logging.getLogger("tsukimi.store.client")
        if not any(isinstance(f, _OncePerOutage) for f in client_logger.filters):
            client_logger.addFilter(_OncePerOutage())  # NOTE: once per process

    def client(self) -> StoreClient | None:
        """The client, or None while the master is (believed) down."""
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                return None
            try:
                self._client = StoreClient(self._config.tsukimi_config(), engine=self._engine)
            except TsukimiError as exc:
                self._mark_down(exc)
                return None
            if self._outage:
                logger.info("store master %s is back; the KV pool is in use again", self._config.master)
                self._outage = False
            return self._client

    def failed(self, exc: TsukimiError) -> None:
        """A call through the client failed for the whole call: plain vLLM for `retry_s`."""
        with self._lock:
            self._mark_down(exc)
            client, self._client = self._client, None
        if client is not None:
            threading.Thread(target=client.close, name="tsukimi-close-client", daemon=True).start()

    def _mark_down(self, exc: TsukimiError) -> None:
        self._down_until = time.monotonic() + self._config.retry_s
        if not self._outage:
            logger.warning("store master %s unreachable (%s): running without the KV pool", self._config.master, exc)
            self._outage = True

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
