"""`tsukimi bench serve --workload overload`: how the bench client (tsukimi/bench/client.py)
sorts one request's end (against a mock API), the figures' accounting and verdicts. The
run against a real `tsukimi up --model tiny` plan, whose invariants must hold whatever the
machine's speed (every request sent ends exactly once, none hangs or fails without a reason, the
cluster answers as before once the load stops), is tests/bench/test_reports.py's overload case."""

from __future__ import annotations

import asyncio
import json
import re

from tsukimi.bench.client import CompletionRequest, CompletionResult, complete
from tsukimi.bench.overload import mixed_requests
from tsukimi.bench.overload_monitor import Probe
from tsukimi.bench.overload_report import LoadRun, render_markdown, summarize, verdicts
from tsukimi.netio import free_port

_REQUEST = CompletionRequest((5, 6, 7), 4, stream=False)
_STREAMED = CompletionRequest((5,), 2, stream=True)


def _send_to(
    response: bytes, request: CompletionRequest = _REQUEST, timeout_s: float = 5.0, delay_s: float = 0.0
) -> CompletionResult:
    """`send` against a loopback server that answers `response` (raw HTTP) after `delay_s`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        match = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        await reader.readexactly(int(match.group(1)) if match else 0)
        await asyncio.sleep(delay_s)
        writer.write(response)
        await writer.drain()
        writer.close()

    async def go() -> CompletionResult:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            return await complete(f"http://127.0.0.1:{port}", "tiny", request, timeout_s)

    return asyncio.run(go())


def _end(outcome: CompletionResult) -> tuple[str, int, str]:
    return outcome.kind, outcome.status, outcome.reason


def _answer(status: int, body: bytes) -> bytes:
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


def _chunked(body: bytes, end: bool = True) -> bytes:
    """A 200 event stream sent chunked, one chunk per event; without the final chunk unless `end`."""
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + chunks + (b"0\r\n\r\n" if end else b"")


def _error(code: str) -> bytes:
    return json.dumps({"error": {"message": f"because {code}", "type": "x", "code": code}}).encode()


def test_a_refusal_with_a_reason_is_rejected_and_one_without_is_a_failure() -> None:
    assert _end(_send_to(_answer(429, _error("ttft_slo")))) == ("rejected", 429, "ttft_slo")
    assert _send_to(_answer(503, _error("worker_unavailable"))).message == "because worker_unavailable"
    assert _end(_send_to(_answer(502, _error("worker_error")))) == ("error", 502, "worker_error")
    failed = _send_to(_answer(500, b"Internal Server Error"))
    assert (failed.kind, failed.status) == ("failed", 500) and "without a reason" in failed.reason
    assert _send_to(_answer(503, b"")).kind == "failed"


def test_a_whole_answer_needs_tokens() -> None:
    body = {"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}}
    served = _send_to(_answer(200, json.dumps(body).encode()))
    assert (served.kind, served.completion_tokens, served.text) == ("served", 2, "ab")
    assert _send_to(_answer(200, b'{"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}')).kind == "failed"
    assert _send_to(_answer(200, b"not json")).kind == "failed"


def test_a_stream_is_served_only_when_it_ends_with_done() -> None:
    events = [
        {"choices": [{"text": "a"}]},
        {"choices": [{"text": "b"}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    whole = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    served = _send_to(_chunked(whole + b"data: [DONE]\n\n"), _STREAMED)
    assert (served.kind, served.completion_tokens, served.text) == ("served", 2, "ab") and served.ttft_s >= 0
    assert _end(_send_to(_chunked(whole), _STREAMED)) == ("failed", 200, "stream cut before [DONE]")
    cut = _send_to(_chunked(whole, end=False), _STREAMED)  # the connection closes mid-body
    assert (cut.kind, cut.status) == ("failed", 200) and cut.reason.startswith("malformed answer"), cut
    broken = whole + b"data: " + _error("worker_unavailable") + b"\n\ndata: [DONE]\n\n"
    assert _end(_send_to(_chunked(broken), _STREAMED)) == ("error", 200, "in stream: worker_unavailable")


def test_no_answer_within_the_timeout_or_no_server_is_a_failure() -> None:
    outcome = _send_to(_answer(200, b"{}"), timeout_s=0.2, delay_s=10)
    assert (outcome.kind, outcome.status) == ("failed", 0) and "timeout" in outcome.reason
    refused = asyncio.run(complete(f"http://127.0.0.1:{free_port()}", "tiny", _REQUEST, 5.0))
    assert _end(refused) == ("failed", 0, "ConnectionRefusedError")


def test_the_mixed_workload_mixes_lengths_prefixes_and_streaming() -> None:
    requests = mixed_requests(400, seed=1)
    assert requests == mixed_requests(400, seed=1) and requests != mixed_requests(400, seed=2)
    assert 0.4 < sum(r.stream for r in requests) / 400 < 0.6
    assert {len(r.prompt) for r in requests} >= {8, 32, 96, 256, 200, 224, 288, 448}  # own, and shared + own
    assert all(2 <= r.max_tokens <= 12 for r in requests)


def test_the_figures_account_for_every_request_and_judge_each_criterion() -> None:
    served = CompletionResult("served", 200, "", True, 0.5, token_times_s=(0.1,), text="abc", completion_tokens=3)
    outcomes = (
        [served] * 6
        + [CompletionResult("rejected", 429, "ttft_slo", False, 0.01)] * 3
        + [CompletionResult("failed", 0, "client timeout (1 s)", False, 1.0)]
    )
    probes = [Probe(0.0, 0.01, True), Probe(0.2, 0.15, True), Probe(0.4, 2.0, False, "ReadTimeout")]
    rss = {"router": [(0.0, 100 << 20), (5.0, 120 << 20), (10.0, 110 << 20)]}
    run = LoadRun(
        2.0,
        8.0,
        outcomes,
        2.0,
        4.0,
        0.0,
        probes,
        (0.0, 10.0),
        {"router": 50.0},
        2.0,
        [],
        rss,
        served,
        [served, CompletionResult("served", 200, "", False, 0.2, text="abd", completion_tokens=3)],
        port_probes=[Probe(0.0, 0.02, True), Probe(0.2, 0.03, True)],
        admission_s=[0.001, 0.002, 0.25],
    )
    figures = summarize(run)
    assert (figures["sent"], figures["served"], figures["rejected"], figures["failed"]) == (10, 6, 3, 1)
    assert (figures["offered_rps"], figures["served_rps"], figures["throughput_rps"]) == (5.0, 3.0, 1.5)
    assert figures["rejected_by"] == {"429 ttft_slo": 3} and figures["failed_by"] == {"0 client timeout (1 s)": 1}
    assert figures["health"] == {
        "probes": 3,
        "failed": 1,
        "p50_ms": 10.0,  # NOTE: nearest rank: of two values, p50 is the lower
        "p99_ms": 150.0,
        "max_ms": 150.0,
        "over_100ms": 2,
    }
    assert figures["rss_mib"] == {
        "router": {"start": 100.0, "peak": 120.0, "end": 110.0, "late_growth": 0.0, "bounded": True}
    }
    assert figures["admission"] == {
        "count": 3,
        "of_sent": 10,
        "p50_ms": 2.0,
        "p99_ms": 250.0,
        "max_ms": 250.0,
        "over_100ms": 1,
    }
    assert {v.name: v.met for v in verdicts(figures)} == {
        "health_under_100ms": False,
        "health_port_p99": True,  # NOTE: the health port answered every probe within 100 ms
        "admission_p99": False,
        "every_request_ended": False,
        "tokens_or_429_503": False,
        "rss_bounded": True,
        "post_load_ok": False,
    }
    assert "| RSS router start / peak / end | 100.0 / 120.0 / 110.0 MiB |" in render_markdown(figures)
