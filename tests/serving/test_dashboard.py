"""The dashboard's parts without a browser: the decision log, the latency series, the totals read
off the router's metrics, the store probe against a real master, `tsukimi up`'s --master for the
router, and the routes (snapshot, events, page, static files) plus `tsukimi top --once` over a
router app with FAKE workers (tests/serving/test_router.py). The page itself in a real browser:
test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import msgspec
import pytest

from tests.serving.fakes import FAST, FakeWorker, close_all
from tsukimi import cli, httpd
from tsukimi.config import ROUTER_CONDUCTOR, ClientConfig, ClusterConfig, ConductorConfig, Config, load
from tsukimi.engine.tokenizer import ByteTokenizer
from tsukimi.netio import free_port
from tsukimi.scheduler.conductor import Decision
from tsukimi.serving.cluster.up import plan
from tsukimi.serving.dashboard import app as dashboard
from tsukimi.serving.dashboard.series import MAX_SAMPLES, SampledHistogram, Series, percentiles
from tsukimi.serving.dashboard.snapshot import Snapshot, Totals, read_counters, totals
from tsukimi.serving.dashboard.store_probe import StoreProbe, StoreView
from tsukimi.serving.openai.app import ApiMetrics, create_app
from tsukimi.serving.router.decision_log import DecisionLog, DecisionRecord
from tsukimi.serving.router.router import Router
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.deployments import MASTER
from tsukimi.testing.processes import wait_until

pytestmark = pytest.mark.timeout(60)
QUICK = dashboard.DashboardConfig(interval_s=0.05, store_interval_s=0.05, stream_s=0.5)


def test_decision_log_keeps_the_newest_by_request_id_and_counts_them_all() -> None:
    log = DecisionLog(capacity=3)
    log.open("r0", 1.0, "colocated", 5).picked("w0")
    log.open("r1", 2.0, "pd", 40).placed(Decision(1, True, prefill="p0", decode="d0", cached_tokens=32, ttft_s=0.25))
    log.open("r2", 3.0, "pd", 40).placed(Decision(2, False, "ttft_slo", prefill="p0", ttft_s=9.0, message="9 s > 1 s"))
    log.open("r3", 4.0, "colocated", 7).picked("w1")
    assert log.total == 4
    assert log.recent() == [
        DecisionRecord("r3", 4.0, "colocated", 7, prefill="w1", seq=3),
        DecisionRecord(
            "r2", 3.0, "pd", 40, False, "ttft_slo", "9 s > 1 s", predicted_ttft_s=9.0, conductor_id=2, seq=2
        ),
        DecisionRecord("r1", 2.0, "pd", 40, predicted_ttft_s=0.25, prefill="p0", decode="d0", conductor_id=1, seq=1),
    ]
    assert [r.seq for r in log.recent(2)] == [3, 2]
    assert [r.request_id for r in log.get(["r1", "r0", "r3"])] == ["r1", "r3"]  # r0 is gone
    again = log.open("r1", 5.0, "pd", 8)  # NOTE: an id seen again: the newer request's record
    assert log.get(["r1"]) == [again] and [r.request_id for r in log.recent()] == ["r1", "r3", "r2"]


def test_percentiles_are_nearest_rank() -> None:
    assert percentiles([]) == [None, None, None]
    assert percentiles([3.0]) == [3.0, 3.0, 3.0]
    assert percentiles([float(x) for x in range(100, 0, -1)]) == [50.0, 90.0, 99.0]


def test_series_rates_and_window() -> None:
    series = Series(capacity=2, window=2)
    first = series.add(10.0, [0.1], [], requests=5, tokens=50)
    assert (first.requests_per_s, first.tokens_per_s, first.tbt_p50_s) == (0.0, 0.0, None)
    second = series.add(12.0, [0.3, 0.2], [0.01], requests=9, tokens=150)
    assert (second.requests_per_s, second.tokens_per_s, second.ttft_p50_s, second.ttft_p99_s) == (2.0, 50.0, 0.2, 0.3)
    series.add(13.0, [0.4], [], requests=9, tokens=150)
    assert [p.wall_s for p in series.points] == [12.0, 13.0]  # bounded
    assert series.window() == ([0.3, 0.4, 0.4], [0.01, 0.01, 0.01], 3)  # the newest two intervals


def test_sampled_histogram_keeps_raw_samples_beside_its_buckets() -> None:
    metrics = ApiMetrics()
    assert isinstance(metrics.ttft, SampledHistogram)
    for x in (0.2, 0.004, 0.3):
        metrics.ttft.observe(x)
    assert metrics.ttft.take() == [0.2, 0.004, 0.3] and metrics.ttft.take() == []
    assert metrics.registry.get_sample_value("tsukimi_router_ttft_seconds_count") == 3.0
    for _ in range(MAX_SAMPLES + 5):
        metrics.tbt.observe(0.01)
    assert len(metrics.tbt.take()) == MAX_SAMPLES  # bounded when no dashboard drains it


def test_totals_and_rejections_from_the_router_metrics() -> None:
    m = ApiMetrics()
    m.requests.labels("completions", "ok").inc(3)
    m.requests.labels("chat", "rejected").inc(2)
    m.rejections.labels("ttft_slo").inc(2)
    m.prompt_tokens.inc(200)
    m.cached_tokens.inc(50)
    m.pool_tokens.inc(20)
    m.completion_tokens.inc(30)
    summary, rejections = totals(read_counters(m.registry))
    assert summary == Totals(3, 2, 200, 30, 50, 20, 0.25, 0.1)
    assert rejections == {"ttft_slo": 2}


def test_up_gives_the_router_the_master_in_pd_mode_only() -> None:
    ports = itertools.count(7001)
    *_, (router,) = plan(load(ClusterConfig, None, ["model=tiny"]), lambda: next(ports))
    args = router.args
    assert args[args.index("--master") + 1] == "tcp://127.0.0.1:7001"
    assert args[args.index("--master-http") + 1] == "http://127.0.0.1:7002"
    *_, (colocated,) = plan(load(ClusterConfig, None, ["model=tiny", "mode=colocated"]), lambda: next(ports))
    assert "--master" not in colocated.args


def test_store_probe_reads_segments_and_objects_and_survives_a_dead_master() -> None:
    with MasterServer(replace(MASTER, rpc_port=free_port(), http_port=free_port())) as master:
        cfg = replace(Config(), client=ClientConfig(master=master.endpoint, segment_bytes=4 << 20))
        with StoreClient(cfg) as holder:
            for key in ("a", "b"):
                holder.put(key, b"x" * 1000)
            probe = StoreProbe(master.endpoint, master.http.base_url, timeout_s=2.0)
            view = asyncio.run(_sample_and_close(probe))
    assert view.error == "" and view.master == master.endpoint
    assert [(s.capacity_bytes, s.used_bytes >= 2000, s.healthy) for s in view.segments] == [(4 << 20, True, True)]
    assert (view.stats["objects"], view.stats["puts_completed"]) == (2.0, 2.0)
    dead = asyncio.run(_sample_and_close(StoreProbe(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3)))
    assert dead.segments == [] and dead.error.startswith("segments: ")
    assert asyncio.run(_sample_and_close(StoreProbe())).master == ""


async def _sample_and_close(probe: StoreProbe) -> StoreView:
    try:
        return await probe.sample()
    finally:
        await probe.aclose()


@pytest.fixture
def router_app() -> Iterator[Callable[..., tuple[httpx.Client, dashboard.Dashboard]]]:
    """router_app(*fake workers, conductor=None) -> a client of a router app with the dashboard."""
    cleanup: list[Callable[[], None]] = []

    def start(
        *workers: FakeWorker, conductor: ConductorConfig | None = None
    ) -> tuple[httpx.Client, dashboard.Dashboard]:
        cleanup.extend(w.close for w in workers)
        app = create_app(Router([w.spec for w in workers], FAST, conductor), ByteTokenizer(), "tiny")
        board = dashboard.mount(app, None, QUICK)
        handle: httpd.AppHandle = httpd.start_in_thread(app)
        client = httpx.Client(base_url=handle.base_url, timeout=10.0)
        cleanup.append(lambda: (client.close(), handle.stop(2.0)))
        return client, board

    yield start
    close_all(cleanup)


def snapshot_when(client: httpx.Client, ready: Callable[[Snapshot], bool]) -> Snapshot:
    found: list[Snapshot] = []

    def check() -> bool:
        found[:] = [msgspec.json.decode(client.get("/dashboard/api/snapshot").content, type=Snapshot)]
        return ready(found[0])

    wait_until(check, 10)
    return found[0]


def test_colocated_snapshot_events_page_and_top(
    router_app: Callable[..., tuple[httpx.Client, dashboard.Dashboard]], capsys: pytest.CaptureFixture[str]
) -> None:
    client, _ = router_app(FakeWorker("w", load={"free_blocks": 60, "total_blocks": 100}))
    for rid in ("a", "b"):
        body = {"prompt": "hello", "max_tokens": 3}
        assert client.post("/v1/completions", json=body, headers={"X-Request-Id": rid}).status_code == 200
    snap = snapshot_when(client, lambda s: s.totals.requests_ok == 2 and s.workers[0].used_blocks == 40)
    assert snap.mode == "colocated" and snap.store.master == ""
    decisions = [(d.request_id, d.prefill, d.mode) for d in snap.decisions]
    assert decisions == [("b", "w", "colocated"), ("a", "w", "colocated")]
    assert snap.totals.completion_tokens == 6 and snap.latency.samples == 2
    with client.stream("GET", "/dashboard/api/events") as stream:  # ends by itself after stream_s
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 2 and all(1 <= len(e["series"]) <= dashboard.EVENT_POINTS for e in events)
    assert [e["seq"] for e in events] == sorted({e["seq"] for e in events})
    page = client.get("/dashboard")
    assert page.status_code == 200 and "/dashboard/static/uPlot.iife.min.js" in page.text
    for name in ("uPlot.iife.min.js", "uPlot.min.css", "dashboard.js", "dashboard.css"):
        assert client.get(f"/dashboard/static/{name}").status_code == 200, name
    assert cli.main(["top", "--url", str(client.base_url), "--once"]) == 0
    out = capsys.readouterr().out
    assert "tsukimi router (colocated) tiny" in out and "requests 2 ok / 0 failed" in out and "40/100" in out


def test_pd_decisions_and_rejections(router_app: Callable[..., tuple[httpx.Client, dashboard.Dashboard]]) -> None:
    slo = dataclasses.replace(ROUTER_CONDUCTOR, rejection="baseline", ttft_slo_s=1e-6)
    client, _ = router_app(FakeWorker("p0", "prefill"), FakeWorker("d0", "decode"), conductor=slo)
    assert client.post("/v1/completions", json={"prompt": "abc"}, headers={"X-Request-Id": "r"}).status_code == 429
    snap = snapshot_when(client, lambda s: s.rejections == {"ttft_slo": 1})
    (d,) = snap.decisions
    assert (d.request_id, d.mode, d.accepted, d.reason, d.prefill) == ("r", "pd", False, "ttft_slo", "")
    assert snap.totals.requests_failed == 1 and snap.decisions_total == 1


def test_top_once_says_when_the_router_is_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["top", "--url", f"http://127.0.0.1:{free_port()}", "--once"]) == 2
    assert "no snapshot from the router" in capsys.readouterr().out
