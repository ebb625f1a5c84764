"""The OpenAI-compatible API over a router and FAKE workers (see test_router.py), the router's
app as `tsukimi router` builds it (`build_router_app`), with the byte-level tokenizer:
completions and chat completions, streamed and not, usage, stop strings (cut text, the worker
stream closed), multi-byte characters, errors with OpenAI bodies (400, 404, 429 with the
Conductor's reason, 502, 503), /v1/models, /health, /metrics, X-Request-Id on every answer and
the decision log behind /decisions.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.serving.fakes import PROMPT, FakeWorker, close_all, dead_url, router_app
from tsukimi import httpd
from tsukimi.config import ROUTER_CONDUCTOR, ConductorConfig
from tsukimi.engine.tokenizer import ByteTokenizer
from tsukimi.serving.openai.app import StopText
from tsukimi.serving.router.router import Router
from tsukimi.serving.router.workers import WorkerSpec

TOKENIZER = ByteTokenizer()
MODEL = "tiny"

Serve = Callable[..., httpx.Client]


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


@pytest.fixture
def serve() -> Iterator[Serve]:
    """serve(*fake workers or specs, conductor=None) -> a client of a router app over them."""
    cleanup: list[Callable[[], None]] = []

    def start(*workers: FakeWorker | WorkerSpec, conductor: ConductorConfig | None = None) -> httpx.Client:
        specs = [w.spec if isinstance(w, FakeWorker) else w for w in workers]
        cleanup.extend(w.close for w in workers if isinstance(w, FakeWorker))
        handle: httpd.AppHandle = httpd.start_in_thread(router_app(*specs, conductor=conductor))
        client = httpx.Client(base_url=handle.base_url, timeout=10.0)

        def stop() -> None:
            client.close()
            handle.stop(2.0)

        cleanup.append(stop)
        return client

    yield start
    close_all(cleanup)


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[httpx.Client, FakeWorker]]:
    """One colocated fake worker behind one router app, for the tests that need no other."""
    fake = FakeWorker("w")
    handle: httpd.AppHandle = httpd.start_in_thread(router_app(fake.spec))
    with httpx.Client(base_url=handle.base_url, timeout=10.0) as client:
        yield client, fake
    close_all([lambda: handle.stop(2.0), fake.close])


Colo = Callable[..., tuple[httpx.Client, FakeWorker]]


@pytest.fixture
def colo(shared: tuple[httpx.Client, FakeWorker]) -> Colo:
    """colo(**knobs) -> the shared client and its fake worker, reconfigured with `knobs`."""

    def configure(**knobs: object) -> tuple[httpx.Client, FakeWorker]:
        shared[1].configure(**knobs)
        return shared

    return configure


def sse(response: httpx.Response) -> list[dict[str, object]]:
    """The data events of a server-sent event stream; checks that it ends with [DONE]."""
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def error_of(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def test_models_health_and_completion(colo: Colo) -> None:
    client, _ = colo(cached=2)
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3})
    body, request_id = response.json(), response.headers["x-request-id"]
    assert body["object"] == "text_completion" and body["id"] == f"cmpl-{request_id}" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": "def", "logprobs": None, "finish_reason": "length"}]
    # NOTE: OpenAI's fields only: the router's diagnostics are in its decision log
    usage = {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert body["usage"] == usage
    [record] = client.get("/decisions", params={"request_id": request_id}).json()["decisions"]
    assert (record["request_id"], record["mode"], record["prefill"], record["accepted"]) == (
        request_id,
        "colocated",
        "w",
        True,
    )
    assert (record["cached_tokens"], record["pool_tokens"], record["expected_cached_tokens"]) == (2, 1, None)
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["mode"] == "colocated"
    assert [(w["name"], w["role"], w["healthy"]) for w in health["workers"]] == [("w", "colocated", True)]


def test_completion_with_token_ids_and_default_max_tokens(colo: Colo) -> None:
    client, fake = colo()
    body = client.post("/v1/completions", json={"prompt": ids("a"), "temperature": 0, "seed": 3}).json()
    assert body["choices"][0]["text"] == "bcdefghijklmnopq" and body["usage"]["completion_tokens"] == 16
    assert (fake.calls[0]["max_tokens"], fake.calls[0]["temperature"], fake.calls[0]["seed"]) == (16, 0.0, 3)


def test_completion_stream(colo: Colo) -> None:
    client, _ = colo()
    payload = {"prompt": "a", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse(client.post("/v1/completions", json=payload))
    *text_chunks, usage = chunks
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == "bcde"  # type: ignore[index]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None] * 3 + ["length"]  # type: ignore[index]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5  # type: ignore[index]


def test_chat_completion(colo: Colo) -> None:
    client, fake = colo(reply=ids("Hi there!"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 20}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi there!"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert fake.calls[0]["prompt_ids"] == ids(rendered)
    assert body["usage"]["prompt_tokens"] == len(ids(rendered)) and body["usage"]["completion_tokens"] == 9


def test_chat_completion_stream(colo: Colo) -> None:
    client, _ = colo(reply=ids("Hi!"))
    chunks = sse(
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    )
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]  # type: ignore[index]
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "H"}, None),
        ({"content": "i"}, None),
        ({"content": "!"}, None),
        ({}, "length"),
    ]


def test_stop_string_cuts_text_and_closes_the_worker_stream(colo: Colo) -> None:
    reply = "Hello, world. And then a long tail that the client never sees."
    client, fake = colo(reply=ids(reply), delay_s=0.005)
    payload = {"prompt": "x", "max_tokens": 100, "stop": ["zzz", "world"]}
    body = client.post("/v1/completions", json=payload).json()
    assert body["choices"][0]["text"] == "Hello, " and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len("Hello, world")
    assert fake.disconnected.wait(2.0)
    chunks = sse(client.post("/v1/completions", json={**payload, "stop": ". And", "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world"  # type: ignore[index]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]


def test_client_disconnect_closes_the_worker_stream(colo: Colo) -> None:
    client, fake = colo(reply=ids("x" * 200), delay_s=0.01)
    with client.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True}) as response:
        assert next(response.iter_lines()).startswith("data: ")
    assert fake.disconnected.wait(2.0)


def test_multibyte_characters_are_never_split(colo: Colo) -> None:
    client, _ = colo(reply=ids("héllo ✓ done"))
    chunks = sse(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True}))
    pieces = [c["choices"][0]["text"] for c in chunks]  # type: ignore[index]
    assert "".join(pieces) == "héllo ✓ done" and not any("\ufffd" in p for p in pieces)
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stop": "✓"}).json()
    assert body["choices"][0]["text"] == "héllo "


def test_stop_text_holds_back_a_possible_stop_prefix() -> None:
    text = StopText(TOKENIZER, ["abc", ""])
    assert [text.push(ids(c)) for c in "xyab"] == ["x", "y", "", ""]
    assert text.push(ids("d")) == "abd" and not text.stopped
    assert text.push(ids("ab")) == "" and text.flush() == "ab"
    text = StopText(TOKENIZER, ["abc"])
    assert text.push(ids("xab")) == "x" and text.push(ids("cde")) == "" and text.stopped
    assert text.push(ids("more")) == "" and text.flush() == ""


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"prompt": "a", "n": 2}, "n must be 1"),
        ({"prompt": "a", "temperature": 3}, "temperature"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": ""}, "must not be empty"),
        ({"max_tokens": 3}, "missing required field `prompt`"),
        ({"prompt": "a", "stop": 3}, "stop"),
    ],
)
def test_bad_completion_requests_are_400(colo: Colo, payload: dict[str, object], message: str) -> None:
    client, fake = colo()
    error = error_of(client.post("/v1/completions", json=payload), 400)
    assert error["type"] == "invalid_request_error" and message in str(error["message"])
    assert fake.calls == []


def test_bad_json_unknown_model_and_bad_chat_are_rejected(colo: Colo) -> None:
    client, _ = colo()
    headers = {"content-type": "application/json"}
    assert "invalid request body" in str(error_of(client.post("/v1/completions", content=b"{", headers=headers), 400))
    error = error_of(client.post("/v1/completions", json={"prompt": "a", "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found"
    assert error_of(client.post("/v1/chat/completions", json={"messages": []}), 400)
    error = error_of(client.post("/v1/chat/completions", json={"messages": [{"role": "user"}], "n": 3}), 400)
    assert "n must be 1" in str(error["message"])


def test_rejection_is_429_with_the_reason(serve: Serve) -> None:
    workers = FakeWorker("p0", "prefill"), FakeWorker("d0", "decode")
    client = serve(*workers, conductor=dataclasses.replace(ROUTER_CONDUCTOR, rejection="baseline", ttft_slo_s=1e-6))
    for stream in (False, True):
        response = client.post(
            "/v1/completions", json={"prompt": "abc", "stream": stream}, headers={"X-Request-Id": f"slo-{stream}"}
        )
        error = error_of(response, 429)
        assert (error["type"], error["code"]) == ("rate_limit_error", "ttft_slo")
        assert response.headers["x-request-id"] == f"slo-{stream}"
    assert 'tsukimi_router_rejections_total{reason="ttft_slo"} 2.0' in client.get("/metrics").text
    records = client.get("/decisions?request_id=slo-True&request_id=nothing&request_id=slo-False").json()["decisions"]
    assert [(r["request_id"], r["accepted"], r["reason"]) for r in records] == [
        ("slo-True", False, "ttft_slo"),
        ("slo-False", False, "ttft_slo"),
    ]
    assert all("TTFT" in r["message"] and r["predicted_ttft_s"] > 1e-6 for r in records)
    assert [r["request_id"] for r in client.get("/decisions").json()["decisions"]] == ["slo-True", "slo-False"]


def test_pd_completion_through_the_api(serve: Serve) -> None:
    client = serve(FakeWorker("p0", "prefill", cached=4), FakeWorker("d0", "decode"))
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, headers={"X-Request-Id": "pd"})
    body = response.json()
    assert TOKENIZER.encode(body["choices"][0]["text"]) == [110, 111, 112]
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    # NOTE: the fake prefill worker publishes no KV events: the router's index expected no reuse
    [record] = client.get("/decisions", params={"request_id": "pd"}).json()["decisions"]
    assert {k: record[k] for k in ("mode", "prefill", "decode", "cached_tokens", "pool_tokens", "queued")} == {
        "mode": "pd",
        "prefill": "p0",
        "decode": "d0",
        "cached_tokens": 4,
        "pool_tokens": 2,
        "queued": False,
    }
    assert (record["expected_cached_tokens"], record["expected_pool_tokens"], record["expected_concurrent"]) == (
        0,
        0,
        False,
    )
    assert client.get("/health").json()["mode"] == "pd"
    assert "tsukimi_router_pool_prompt_tokens_total 2.0" in client.get("/metrics").text


def test_worker_failures_are_502_and_503(serve: Serve) -> None:
    client = serve(FakeWorker("w", status=500))
    assert error_of(client.post("/v1/completions", json={"prompt": "a"}), 502)["code"] == "worker_error"
    client = serve(WorkerSpec("dead", "colocated", dead_url()))
    for stream in (False, True):
        error = error_of(
            client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": stream}
            ),
            503,
        )
        assert error["code"] == "worker_unavailable"
    assert client.get("/health").json()["status"] == "degraded"


def test_regression_a_duplicate_request_id_is_409_not_502() -> None:
    """A request id already running at the worker (the engine's one check) used to be turned
    into a generic worker error on its way back and reach the API client as 502. Also: token
    ids outside the vocabulary are answered 400 by the API (tests/serving/test_openai_validation.py)."""
    from tsukimi.engine.weights import load_model
    from tsukimi.serving.worker.server import Worker, WorkerConfig

    with Worker(WorkerConfig(name="colo", model="tiny", num_blocks=512), load_model("tiny")).start() as worker:
        handle: httpd.AppHandle = httpd.start_in_thread(router_app(WorkerSpec("colo", "colocated", worker.base_url)))
        try:
            with httpx.Client(base_url=handle.base_url, timeout=30.0) as client:
                long = {"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True, "stream": True}
                with client.stream("POST", "/v1/completions", json=long, headers={"X-Request-Id": "dup"}) as first:
                    assert first.status_code == 200
                    lines = first.iter_lines()  # NOTE: kept: a dropped iterator closes the connection
                    assert next(lines).startswith("data: ")  # the request runs at the worker now
                    second = client.post("/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "dup"})
                    error = error_of(second, 409)
                    assert (error["type"], error["code"]) == ("invalid_request_error", "duplicate_request")
                    assert "cmpl-dup" in str(error["message"]) and "colo" not in str(error["message"])
                error = error_of(client.post("/v1/completions", json={"prompt": [1, 99999]}), 400)
                assert error["code"] == "invalid_argument" and "vocabulary 0..31999" in str(error["message"])
        finally:
            handle.stop(2.0)


def test_metrics(serve: Serve) -> None:
    client = serve(FakeWorker("w", cached=2, load={"waiting": 3}))
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
    client.post("/v1/completions", json={"prompt": "abc", "n": 2})
    text = client.get("/metrics").text
    for line in (
        "tsukimi_router_ttft_seconds_count 1.0",
        "tsukimi_router_tbt_seconds_count 3.0",
        'tsukimi_router_requests_total{endpoint="completions",outcome="ok"} 1.0',
        'tsukimi_router_requests_total{endpoint="completions",outcome="bad_request"} 1.0',
        "tsukimi_router_prompt_tokens_total 3.0",
        "tsukimi_router_completion_tokens_total 4.0",
        "tsukimi_router_cached_prompt_tokens_total 2.0",
        'tsukimi_router_worker_waiting{role="colocated",worker="w"} 3.0',
        'tsukimi_router_worker_up{role="colocated",worker="w"} 1.0',
    ):
        assert line in text, line
    assert 'tsukimi_router_ttft_seconds_bucket{le="0.005"}' in text


def test_real_workers_pd_matches_colocated() -> None:
    """The real engine behind the API: greedy PD (prefill worker -> KV pool -> decode worker)
    gives the colocated worker's text, and the prompt's blocks are then reused."""
    from tsukimi.config import WorkerConfig
    from tsukimi.engine.weights import load_model
    from tsukimi.serving.worker.server import Worker
    from tsukimi.testing.deployments import TsukimiCluster

    tiny = load_model("tiny")
    prompt = "The quick brown fox jumps over the lazy dog. " * 2  # 90 tokens: 5 full blocks of 16
    payload = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with TsukimiCluster(holder_bytes=0, num_holders=0) as store:
        pool = {"model": "tiny", "master": store.master_addr, "segment_bytes": 16 << 20, "num_blocks": 64}
        with (
            Worker(WorkerConfig(name="colo", model="tiny", num_blocks=64), tiny).start() as colo,
            Worker(WorkerConfig(name="p0", role="prefill", **pool), tiny).start() as prefill,  # type: ignore[arg-type]
            Worker(WorkerConfig(name="d0", role="decode", **pool), tiny).start() as decode,  # type: ignore[arg-type]
        ):
            texts = []
            pd = [WorkerSpec("p0", "prefill", prefill.base_url), WorkerSpec("d0", "decode", decode.base_url)]
            for specs in ([WorkerSpec("colo", "colocated", colo.base_url)], pd):
                app = router_app(*specs, conductor=dataclasses.replace(ROUTER_CONDUCTOR, rejection="none"))
                router: Router = app.state.server.router
                handle: httpd.AppHandle = httpd.start_in_thread(app)
                try:
                    with httpx.Client(base_url=handle.base_url, timeout=30.0) as client:
                        first = client.post("/v1/completions", json=payload).json()
                        again = client.post("/v1/completions", json=payload, headers={"X-Request-Id": "again"}).json()
                        [record] = client.get("/decisions?request_id=again").json()["decisions"]
                finally:
                    handle.stop(2.0)
                assert first["choices"][0]["text"] == again["choices"][0]["text"]
                assert first["usage"]["completion_tokens"] == 12
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == record["cached_tokens"] == 80
                if router.mode == "pd":  # NOTE: the router's index heard of the blocks from p0's KV events
                    assert record["expected_cached_tokens"] == 80
                texts.append(first["choices"][0]["text"])
            assert texts[0] == texts[1]
            assert router.block_tokens == 16
            assert router.index.locations() == ["p0/dram", "pool/dram"]


def test_every_answer_carries_the_request_id(colo: Colo) -> None:
    client, _ = colo()
    mine = client.post("/v1/completions", json={"prompt": "a", "n": 2}, headers={"X-Request-Id": "bad-1"})
    assert error_of(mine, 400) and mine.headers["x-request-id"] == "bad-1"
    theirs = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert theirs.status_code == 200 and len(theirs.headers["x-request-id"]) == 32
    assert sse(theirs)[0]["id"] == f"chatcmpl-{theirs.headers['x-request-id']}"
    # a request turned away before placement leaves no record; one placed does
    ids = ["bad-1", theirs.headers["x-request-id"]]
    assert [r["request_id"] for r in client.get("/decisions", params={"request_id": ids}).json()["decisions"]] == [
        theirs.headers["x-request-id"]
    ]


def test_return_token_ids(colo: Colo) -> None:
    """vLLM's extension: each choice carries its token ids too (streamed: each chunk's)."""
    client, _ = colo()
    body = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "return_token_ids": True}).json()
    assert body["choices"][0]["token_ids"] == ids("bcd")
    payload = {"prompt": "a", "max_tokens": 3, "return_token_ids": True, "stream": True}
    chunks = sse(client.post("/v1/completions", json=payload))
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids("bcd")  # type: ignore[index]
    plain = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3}).json()
    assert "token_ids" not in plain["choices"][0]
