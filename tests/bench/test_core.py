"""The benchmark core without a cluster: the one report type (round trip, `quiet_machine`, the
goal verdicts, the three printed forms), warm-up-then-measure, the client's request ids, token
ids and usage (against a mock API), and the router's decision records as the benches read them
(recorded JSON and a fake `GET /decisions`)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from rich.console import Console

from tsukimi.bench.client import CompletionRequest, complete
from tsukimi.bench.decisions import DecisionRecord, fetch_decisions, index_accuracy, parse_decisions
from tsukimi.bench.measure import Spread, rate, repeat
from tsukimi.bench.report import (
    LOADED,
    QUIET_MACHINE,
    BenchReport,
    FigureViews,
    HostFacts,
    Verdict,
    begin,
    finish,
    goal,
    print_report,
    quiet_machine,
    render_markdown,
)
from tsukimi.errors import ConfigError, ProtocolError


def _host(load_start: float, load_end: float, cpus: int = 2) -> HostFacts:
    return HostFacts(cpus, (load_start, 0.0, 0.0), (load_end, 0.0, 0.0), "cpu", "3.11", "", "Linux")


def test_a_report_round_trips_through_json() -> None:
    start = begin("bench demo", {"sizes": (1, 2), "name": "x"})
    report = finish(start, {"gbps": 1.5, "missing": math.nan, "rows": [(1, 2)]}, [goal("g", "x / y", 0.4, "<=", 0.5)])
    again = BenchReport.from_json(report.to_json())
    assert again.command == "bench demo" and again.configuration == {"sizes": [1, 2], "name": "x"}
    assert again.figures == {"gbps": 1.5, "missing": None, "rows": [[1, 2]]}  # NaN is JSON null
    assert [v.name for v in again.verdicts] == ["g", QUIET_MACHINE] and again.verdict("g") == Verdict(
        "g", "x / y <= 0.5", True, "0.4"
    )
    assert again.revision and again.host.cpus >= 1 and again.host.device == "cpu"


@pytest.mark.parametrize("text", ["not json", "{}", '{"command": 1}', "[]"])
def test_what_is_not_a_report_is_a_protocol_error(text: str) -> None:
    with pytest.raises(ProtocolError, match="not a bench report"):
        BenchReport.from_json(text)


def test_a_loaded_machine_says_so_at_either_end() -> None:
    assert quiet_machine(_host(1.9, 2.0)).met is True
    for loads in ((2.5, 1.0), (1.0, 2.5)):
        verdict = quiet_machine(_host(*loads))
        assert verdict.met is False and LOADED in verdict.detail and "2 CPUs" in verdict.detail


def test_goals_compare_and_say_when_not_measured() -> None:
    assert goal("a", "ratio", 0.7, "<=", 0.65).met is False
    assert goal("b", "ratio", 1.0, ">=", 1.0).met is True
    unknown = goal("c", "ratio", None, ">=", 1.0)
    assert (unknown.met, unknown.detail, unknown.goal) == (None, "not measured in this run", "ratio >= 1")
    assert goal("d", "ratio", math.nan, "<=", 1.0).met is None


def test_one_function_prints_json_markdown_or_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    report = finish(begin("bench demo", {}), {"x": 1}, [Verdict("v", "x >= 1", True, "1")])
    views = FigureViews(markdown=lambda figures: f"X is {figures['x']}")
    print_report(report, "json", Console(file=io.StringIO()), views)
    assert BenchReport.from_json(capsys.readouterr().out) == report
    print_report(report, "markdown", Console(file=io.StringIO()), views)
    text = capsys.readouterr().out
    assert text.startswith("`tsukimi bench demo`, git ") and "X is 1" in text and "| v | x >= 1 | yes | 1 |" in text
    table = io.StringIO()
    print_report(report, "table", Console(file=table, width=200), views)
    assert "X is 1" in table.getvalue() and QUIET_MACHINE in table.getvalue()
    assert "| x | 1 |" in render_markdown(report)  # the generic view of figures without one of their own


def test_repeat_warms_up_then_keeps_the_measured_runs() -> None:
    seen: list[int] = []
    kept = repeat(lambda i: seen.append(i) or i * 10, warmup_runs=2, repeats=3)
    assert seen == [-2, -1, 0, 1, 2] and kept == [0, 10, 20]
    timed: list[int] = []
    repeat(timed.append, warmup_s=0.05, repeats=1)
    assert timed[-1] == 0 and len(timed) > 1 and timed[:-1] == list(range(-1, -len(timed), -1))
    with pytest.raises(ConfigError):
        repeat(lambda i: i, repeats=0)


def test_spread_is_nearest_rank_and_rate_counts_after_the_warm_up() -> None:
    assert Spread.of([3.0, 1.0, 2.0, 10.0]) == Spread(2.0, 1.0, 10.0, 4)
    assert Spread.of([math.nan]).count == 0 and math.isnan(Spread.of([]).median)
    assert Spread.of([2.0, 4.0]).relative == 1.0
    steps = []
    per_s = rate(lambda: steps.append(1) or 100, warmup_s=0.0, duration_s=0.05)
    assert per_s > 0 and len(steps) >= 1
    with pytest.raises(ConfigError):
        rate(lambda: 1, 0.0, 0.0)


def _serve(answer: bytes) -> tuple[str, list[bytes]]:
    """A one-shot mock API answering `answer` (raw HTTP); its URL and the requests' heads."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        match = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        await reader.readexactly(int(match.group(1)) if match else 0)
        writer.write(answer)
        await writer.drain()
        writer.close()

    return handle, heads  # type: ignore[return-value]


def test_the_client_sends_and_returns_the_request_id_with_token_ids_and_usage() -> None:
    events = [
        {"choices": [{"text": "a", "token_ids": [7]}]},
        {"choices": [{"text": "b", "token_ids": [8]}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}},
        },
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    answer = b"HTTP/1.1 200 OK\r\nX-Request-Id: r-42\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    handle, heads = _serve(answer)

    async def go() -> object:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)  # type: ignore[arg-type]
        async with server:
            port = server.sockets[0].getsockname()[1]
            request = CompletionRequest((1, 2, 3), 2, request_id="r-42", return_token_ids=True)
            return await complete(f"http://127.0.0.1:{port}", "tiny", request, 5.0)

    result = asyncio.run(go())
    assert b"x-request-id: r-42" in heads[0].lower()
    assert result.request_id == "r-42" and result.kind == "served"  # type: ignore[attr-defined]
    assert result.token_ids == (7, 8) and result.text == "ab" and len(result.token_times_s) == 2  # type: ignore[attr-defined]
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (3, 2, 2)  # type: ignore[attr-defined]
    assert result.tbt_s >= 0 and result.ttft_s >= 0  # type: ignore[attr-defined]


RECORDED = {
    "decisions": [
        {
            "request_id": "a",
            "time_s": 1.0,
            "mode": "pd",
            "prompt_tokens": 600,
            "accepted": True,
            "reason": "",
            "message": "",
            "queued": True,
            "predicted_ttft_s": 1.5,
            "prefill": "prefill-0",
            "decode": "decode-0",
            "expected_cached_tokens": 512,
            "expected_pool_tokens": 0,
            "expected_concurrent": False,
            "cached_tokens": 512,
            "pool_tokens": 0,
            "a_field_added_later": 1,
        },
        {
            "request_id": "b",
            "time_s": 1.1,
            "mode": "pd",
            "prompt_tokens": 600,
            "accepted": False,
            "reason": "ttft_slo",
            "predicted_ttft_s": 3.0,
            "cached_tokens": None,
        },
    ]
}


def test_decision_records_parse_from_recorded_json() -> None:
    a, b = parse_decisions(json.dumps(RECORDED))
    assert (a.request_id, a.queued, a.predicted_ttft_s, a.expected_cached_tokens, a.cached_tokens) == (
        "a",
        True,
        1.5,
        512,
        512,
    )
    assert (b.accepted, b.reason, b.cached_tokens, b.expected_cached_tokens) == (False, "ttft_slo", None, None)
    with pytest.raises(ProtocolError):
        parse_decisions(b'{"records": []}')


def test_index_accuracy_sorts_misses_by_direction_and_cause() -> None:
    records = [
        DecisionRecord("1", 0.0, "pd", 64, expected_cached_tokens=32, cached_tokens=32),
        DecisionRecord("2", 0.0, "pd", 64, expected_cached_tokens=48, cached_tokens=32, expected_concurrent=True),
        DecisionRecord("3", 0.0, "pd", 64, expected_cached_tokens=0, cached_tokens=16),
        DecisionRecord("4", 0.0, "pd", 64, expected_cached_tokens=None, cached_tokens=16),  # colocated: not counted
    ]
    assert index_accuracy(records) == {
        "index_exact_ratio": round(1 / 3, 4),
        "index_up_to_date_ratio": round(2 / 3, 4),
        "index_mismatches": {"over_concurrent": 1, "over_behind": 0, "under_concurrent": 0, "under_behind": 1},
    }
    assert index_accuracy([])["index_exact_ratio"] is None


@pytest.fixture
def decisions_api() -> Iterator[tuple[str, list[list[str]]]]:
    """A fake router: GET /decisions answers the recorded records of the ids asked, in order."""
    asked: list[list[str]] = []
    by_id = {r["request_id"]: r for r in RECORDED["decisions"]}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path != "/decisions":
                self.send_error(404)
                return
            ids = parse_qs(url.query).get("request_id", [])
            asked.append(ids)
            body = json.dumps({"decisions": [by_id[i] for i in ids if i in by_id]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_decisions_asks_by_request_id_in_batches(decisions_api: tuple[str, list[list[str]]]) -> None:
    url, asked = decisions_api
    ids = ["a", "nobody", *(f"x{i}" for i in range(70)), "b", "a"]
    found = fetch_decisions(url, ids)
    assert set(found) == {"a", "b"} and found["b"].reason == "ttft_slo"
    assert [len(batch) for batch in asked] == [64, 9]  # each id once, 64 per request
    assert fetch_decisions(url + "/no-such-router", ["a"]) == {}  # 404: a router without the endpoint


def test_regression_serve_judges_the_index_on_the_runs_that_reuse() -> None:
    """The no_reuse run's workers cache nothing, so the index misses there by design: its ratio
    (0.375 in a real run) once failed the index_exact verdict of a healthy router."""
    from tsukimi.bench.serve import verdicts

    figures = {"runs": {"reuse": {"index_exact_ratio": 1.0}, "no_reuse": {"index_exact_ratio": 0.375}}}
    judged = {v.name: v for v in verdicts({**figures, "ttft_p50_ratio": 0.13})}
    assert judged["index_exact"].met is True and float(judged["index_exact"].detail) == 1.0
    assert judged["reuse_ttft_p50"].met is True
