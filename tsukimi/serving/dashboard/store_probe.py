"""What the dashboard shows of the KV pool: the store master's segments and objects.

    --master tcp://HOST:PORT | etcd://...   ListSegments over the master's RPC (MasterLink: follows
                                            an HA leader) -> each segment's used / capacity bytes
    --master-http http://HOST:PORT          the master's GET /metrics (Prometheus text, unsigned)
                                            -> complete objects, pending puts, hits, misses, evictions

The master keeps no per-segment object count, so objects are counted for the whole pool.
`StoreProbe.sample` runs the blocking RPC in a thread and bounds every call by a timeout: a
master that is down makes the view say so (`error`), never the router wait.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from tsukimi.config import ClientConfig
from tsukimi.errors import TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.master_link import MasterLink

logger = logging.getLogger(__name__)

# the master's /metrics samples the dashboard shows, by the name it shows them under
MASTER_SAMPLES = {
    "objects": "tsukimi_master_objects",
    "pending_puts": "tsukimi_master_pending_puts",
    "hits": "tsukimi_master_hits_total",
    "misses": "tsukimi_master_misses_total",
    "evictions": "tsukimi_master_evictions_total",
    "puts_completed": "tsukimi_master_puts_completed_total",
}


class SegmentRow(msgspec.Struct, frozen=True):
    """One memory segment of the pool, as the master lists it."""

    segment_id: str
    client_id: str
    used_bytes: int
    capacity_bytes: int
    healthy: bool


class StoreView(msgspec.Struct, frozen=True):
    """The pool as last probed. `master`: the address probed ("": no master configured);
    `error`: why the last probe failed ("" when it did not); `stats`: MASTER_SAMPLES' values
    (empty without `--master-http`)."""

    master: str = ""
    error: str = ""
    segments: list[SegmentRow] = msgspec.field(default_factory=list)
    stats: dict[str, float] = msgspec.field(default_factory=dict)


class StoreProbe:
    """Asks the master for its segments (and, given its HTTP URL, its counts); see the module.

    Args:
        master: tcp://HOST:PORT or etcd://HOST:PORT[,...] ("": none; the view stays empty).
        master_http: the master's HTTP base URL ("": objects are not counted).
        secret: the cluster secret the master's RPC needs, if it has one.
        timeout_s: bounds each call.
    """

    def __init__(
        self, master: str = "", master_http: str = "", secret: bytes | None = None, timeout_s: float = 2.0
    ) -> None:
        self._http_url, self._timeout_s = master_http.rstrip("/"), timeout_s
        self.address = master or self._http_url  # what the view names
        config = ClientConfig(master=master, rpc_timeout_s=timeout_s, failover_timeout_s=timeout_s) if master else None
        self._link = MasterLink(config, p.CODEC, secret) if config is not None else None
        self._http = httpx.AsyncClient(timeout=timeout_s) if self._http_url else None

    async def sample(self) -> StoreView:
        """The pool now; never raises for a master that fails (the view carries the error)."""
        if self._link is None and self._http is None:
            return StoreView()
        errors: list[str] = []
        segments: list[SegmentRow] = []
        stats: dict[str, float] = {}
        if self._link is not None:
            try:
                segments = await asyncio.to_thread(self._segments, self._link)
            except TsukimiError as exc:
                errors.append(f"segments: {exc}")
        if self._http is not None:
            try:
                stats = await self._stats(self._http)
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"{self._http_url}/metrics: {exc!r}")
        return StoreView(self.address, "; ".join(errors), segments, stats)

    def _segments(self, link: MasterLink) -> list[SegmentRow]:
        reply = link.call_as(p.ListSegments(), p.SegmentsResult, attempt_s=self._timeout_s)
        return [SegmentRow(s.segment_id, s.client_id, s.used, s.capacity, s.healthy) for s in reply.segments]

    async def _stats(self, http: httpx.AsyncClient) -> dict[str, float]:
        response = await http.get(f"{self._http_url}/metrics")
        response.raise_for_status()
        values = {s.name: s.value for family in text_string_to_metric_families(response.text) for s in family.samples}
        return {shown: values[name] for shown, name in MASTER_SAMPLES.items() if name in values}

    async def aclose(self) -> None:
        """Closes the connections (idempotent)."""
        if self._link is not None:
            await asyncio.to_thread(self._link.close)
        if self._http is not None:
            await self._http.aclose()
