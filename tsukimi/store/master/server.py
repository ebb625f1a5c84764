"""`tsukimi master`: the store master process around the pure state machine.

Three things share one lock, so the state machine sees one operation at a time: the RPC
server's thread (clients' operations), a ticker thread (`MasterState.tick` every
`tick_interval_s`), and the HTTP endpoints `/health`, `/metrics` (Prometheus), `/query_key`,
`/segments`, and Mooncake's `/metrics/summary`, `/get_all_keys` (paged: `limit`,
`start_after`; the next page's `start_after` in the `X-Next-Start-After` header) and
`/batch_query_keys?keys=a,b` (reports.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Awaitable, Callable, Iterator

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tsukimi import auth, httpd
from tsukimi.clock import Clock, WallClock
from tsukimi.config import MasterConfig
from tsukimi.errors import AuthError, InvalidArgument, NotLeader, ObjectNotFound
from tsukimi.rpc import RpcServer
from tsukimi.store import protocol as p
from tsukimi.store.ha import journal
from tsukimi.store.ha.leader import HAController
from tsukimi.store.leader_record import LeaderInfo
from tsukimi.store.master import reports
from tsukimi.store.master.service import MasterService
from tsukimi.store.master.state import MasterState

logger = logging.getLogger(__name__)

COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "evicted_bytes",
    "puts_started",
    "puts_completed",
    "puts_revoked",
    "puts_reclaimed",
    "removes",
    "objects_lost",
    "offloads",
    "offloaded_bytes",
    "offloads_failed",
    "offloads_discarded",
    "promotions",
    "promoted_bytes",
    "promotions_failed",
    "promotions_discarded",
    "promotions_skipped",
    "memory_freed_to_disk",
    "disk_evictions",
    "disk_adopted",
    "disk_tasks_expired",
    "hot_replications",
    "hot_drops",
    "hot_sheds",
)


class MasterServer:
    """Serves a `MasterState` over RPC and HTTP until `close()`."""

    def __init__(self, config: MasterConfig, clock: Clock | None = None, secret: bytes | None = None) -> None:
        """`secret`: the cluster secret (SecurityConfig.secret()): RPC clients must prove it."""
        self.config = config
        self._clock = clock or WallClock()
        self.state = MasterState(config, self._clock, epoch=secrets.randbits(30) + 1)
        self.service = MasterService(self.state)
        self.ha: HAController | None = None
        self._secret = secret
        self._lock = threading.Lock()
        self._unsettled = threading.local()  # the HA log entry each connection thread waits for
        self._stop = threading.Event()
        self.metrics = CollectorRegistry()
        self.metrics.register(_StateCollector(self))
        self._latency = Histogram(
            "tsukimi_master_op_seconds",
            "Master operation latency",
            ["op"],
            registry=self.metrics,
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
        )
        self.rpc = RpcServer(
            p.CODEC,
            self._handle,
            bind=f"tcp://{config.host}:{config.rpc_port}",
            name="master",
            spin_s=config.rpc_spin_us * 1e-6,
            spinners=config.rpc_spinners,
            settle=self._settle if config.ha_etcd else None,
            secret=secret,
        )
        try:
            self.http: httpd.AppHandle = httpd.start_in_thread(self._app(), config.host, config.http_port)
        except BaseException:
            self.rpc.close()
            raise
        self._ticker = threading.Thread(target=self._tick_loop, name="tsukimi-master-tick", daemon=True)
        self._ticker.start()
        if config.ha_etcd:
            self.state.take_changes()  # starts tracking the rows to log
            info = LeaderInfo(self.rpc.endpoint, self.http.base_url, f"{config.host}:{self.rpc.port}", os.getpid())
            self.ha = HAController(config, info, self._install, self._forget, self._snapshot)
            self.ha.start()
        logger.info("master serving RPC on %s, HTTP on %s", self.rpc.endpoint, self.http.base_url)

    @property
    def role(self) -> str:
        """ "leader" (also a master without HA) or "standby"."""
        return "leader" if self.ha is None or self.ha.leading() else "standby"

    @property
    def endpoint(self) -> str:
        return self.rpc.endpoint

    def _handle(self, request: msgspec.Struct) -> msgspec.Struct:
        with self._latency.labels(type(request).__name__).time(), self._lock:
            if self.ha is not None and not self.ha.leading():
                raise NotLeader(f"master {self.ha.info.name} is not the leader (find it in etcd)")
            if self.ha is None:
                return self.service.handle(request)
            try:
                return self.service.handle(request)
            finally:
                self._unsettled.logged = self._log_changes()

    def _settle(self) -> None:
        """Wait until what the last request on this thread changed is in etcd (HA; runs
        outside the RPC handler lock, so one etcd transaction commits many requests)."""
        logged, self._unsettled.logged = getattr(self._unsettled, "logged", None), None
        if logged is not None:
            assert self.ha is not None
            self.ha.wait(*logged)

    def _log_changes(self) -> tuple[int, int] | None:
        """Queue the rows the last operation changed for the HA log (caller holds the lock); the
        log entry to wait for before answering (one that changed nothing: the last one queued)."""
        if self.ha is None:
            return None
        changes = self.state.take_changes()
        return self.ha.append(journal.records_of(self.state, changes)) if changes else self.ha.barrier()

    def _install(self, tables: journal.Tables) -> None:
        """Become the leader with the state the log holds (HA campaign thread)."""
        state = journal.restore(tables, self.config, self._clock, secrets.randbits(30) + 1)
        state.take_changes()
        with self._lock:
            self.state, self.service = state, MasterService(state)

    def _forget(self) -> None:
        """Leadership ended: drop the state (a next term starts from the log)."""
        state = MasterState(self.config, self._clock, epoch=secrets.randbits(30) + 1)
        state.take_changes()
        with self._lock:
            self.state, self.service = state, MasterService(state)

    def _snapshot(self) -> tuple[int, list[journal.Record]]:
        with self._lock:
            assert self.ha is not None
            return self.ha.appended, journal.snapshot_of(self.state)

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.config.tick_interval_s):
            with self._lock:
                if self.ha is not None and not self.ha.leading():
                    continue
                try:
                    self.state.tick()
                except Exception:  # NOTE: a bug in one tick must not stop expiry for good
                    logger.exception("master tick failed")
                self._log_changes()

    def _app(self) -> FastAPI:
        app = FastAPI(title="tsukimi master")

        @app.get("/health")
        def health() -> dict[str, object]:
            return {"status": "ok", "role": self.role, "term": self.ha.term if self.ha else 0}

        @app.get("/metrics")
        def metrics() -> Response:
            return Response(generate_latest(self.metrics), media_type=CONTENT_TYPE_LATEST)

        async def signed(request: Request) -> None:
            """With a cluster secret, the state endpoints need a signed request (tsukimi/auth.py)."""
            if self._secret is None:
                return
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            try:
                auth.verify_headers(
                    self._secret, request.method, target, await request.body(), request.headers, auth.wall_time()
                )
            except AuthError as exc:
                raise HTTPException(401, str(exc)) from exc

        @app.get("/query_key", dependencies=[Depends(signed)])
        def query_key(key: str) -> dict[str, object]:
            if self.role != "leader":
                raise HTTPException(503, "this master is a standby: ask the leader")
            try:
                with self._lock:
                    info = self.state.describe(key)
            except InvalidArgument as exc:
                raise HTTPException(400, str(exc)) from exc
            except ObjectNotFound as exc:
                raise HTTPException(404, str(exc)) from exc
            return msgspec.to_builtins(info)  # type: ignore[no-any-return]

        @app.get("/segments", dependencies=[Depends(signed)])
        def segments() -> list[dict[str, object]]:
            with self._lock:
                infos = self.state.registry.infos(self.state.clock.now())
            return [msgspec.to_builtins(info) for info in infos]

        self._mooncake_routes(app, signed)
        return app

    def _mooncake_routes(self, app: FastAPI, signed: Callable[[Request], Awaitable[None]]) -> None:
        """Mooncake's master endpoints: /metrics/summary, /get_all_keys, /batch_query_keys,
        /get_all_segments (SGLang's `MOONCAKE_CHECK_SERVER` polls it until a segment is there)."""

        @app.get("/metrics/summary")
        def metrics_summary() -> PlainTextResponse:
            with self._lock:
                return PlainTextResponse(reports.summary(self.state, self.role) + "\n")

        @app.get("/get_all_keys", dependencies=[Depends(signed)])
        def get_all_keys(
            limit: int = Query(reports.MAX_KEYS_PAGE, ge=1, le=reports.MAX_KEYS_PAGE), start_after: str = ""
        ) -> PlainTextResponse:
            with self._lock:
                keys, after = reports.all_keys(self.state, start_after, limit)
            headers = {"X-Next-Start-After": after} if after else {}
            return PlainTextResponse("".join(f"{k}\n" for k in keys), headers=headers)

        @app.get("/get_all_segments", dependencies=[Depends(signed)])
        def get_all_segments() -> PlainTextResponse:
            if self.role != "leader":
                raise HTTPException(503, "this master is a standby: ask the leader")
            with self._lock:
                names = {info.te_segment for info in self.state.registry.infos(self.state.clock.now())}
            return PlainTextResponse("".join(f"{name}\n" for name in sorted(names)))

        @app.get("/batch_query_keys", dependencies=[Depends(signed)])
        def batch_query_keys(keys: str = "") -> JSONResponse:
            wanted = [k for k in keys.split(",") if k]
            if not wanted:
                return JSONResponse({"success": False, "error": "No keys provided. Use ?keys=key1,key2,..."}, 400)
            with self._lock:
                data = reports.batch_query(self.state, wanted)
            return JSONResponse({"success": True, "data": data})

    def close(self) -> None:
        """Stop serving (idempotent). Without HA the state is lost; an HA leader hands over."""
        if self.ha is not None:
            self.ha.close()
        self._stop.set()
        self.rpc.close()
        self.http.stop()
        self._ticker.join(timeout=5)

    def __enter__(self) -> MasterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StateCollector:
    """Reads the state at scrape time (under the server's lock)."""

    def __init__(self, server: MasterServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        server = self._server
        with server._lock:
            state = server.state
            counters = dict(state.counters)
            objects, pending = len(state.objects), len(state.pending)
            segments = state.registry.infos(state.clock.now())
            disks = [(d.disk_id, d.used, d.capacity) for d in state.tiers.registry.disks.values()]
            rates = reports.tier_rates(state)
        yield GaugeMetricFamily("tsukimi_master_objects", "Complete objects", value=objects)
        yield GaugeMetricFamily("tsukimi_master_pending_puts", "Puts started and not ended", value=pending)
        used = GaugeMetricFamily("tsukimi_master_segment_used_bytes", "Bytes allocated per segment", labels=["segment"])
        capacity = GaugeMetricFamily(
            "tsukimi_master_segment_capacity_bytes", "Capacity per segment", labels=["segment"]
        )
        for info in segments:
            used.add_metric([info.segment_id], info.used)
            capacity.add_metric([info.segment_id], info.capacity)
        yield used
        yield capacity
        for name in COUNTERS:
            yield CounterMetricFamily(
                f"tsukimi_master_{name}", f"Master {name.replace('_', ' ')}", value=counters.get(name, 0)
            )
        yield from _tier_metrics(disks, rates)


def _tier_metrics(disks: list[tuple[str, int, int]], rates: reports.TierRates) -> Iterator[Metric]:
    """Each disk's use, and the holders' copy bandwidth to disk and back."""
    used = GaugeMetricFamily("tsukimi_master_disk_used_bytes", "Bytes of copies per disk", labels=["disk"])
    capacity = GaugeMetricFamily("tsukimi_master_disk_capacity_bytes", "Capacity per disk", labels=["disk"])
    for disk_id, disk_used, disk_capacity in disks:
        used.add_metric([disk_id], disk_used)
        capacity.add_metric([disk_id], disk_capacity)
    yield used
    yield capacity
    yield GaugeMetricFamily(
        "tsukimi_master_offload_bytes_per_second",
        "Holders' offload bandwidth (bytes per second of copying)",
        value=rates.offload_bytes_per_s,
    )
    yield GaugeMetricFamily(
        "tsukimi_master_promotion_bytes_per_second",
        "Holders' promotion bandwidth (bytes per second of copying)",
        value=rates.promotion_bytes_per_s,
    )
