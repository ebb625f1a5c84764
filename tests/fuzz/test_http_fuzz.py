"""Fuzzing the HTTP surfaces: query strings, paths, headers and JSON bodies.

Targets:
  http-master    the store master's /query_key, /segments, /health (raw requests: any query
                 bytes, paths, methods): a 4xx or a 200, never a 5xx, never a hang.
  http-metadata  the metadata server's /metadata?key= GET/PUT/DELETE and /metadata/list with
                 any key, prefix, ttl_s, If-Match / If-None-Match, body and Content-Length:
                 2xx, 404 or another 4xx (412 included), and a good PUT/GET works after.
  http-worker    a real worker (tiny model): POST /generate with damaged bodies (wrong types,
                 huge or negative numbers, strings that are not UTF-8, deep nesting): a 200
                 stream that finishes, or a 4xx with a message; a good request works after.
  http-openai    the OpenAI router over that worker: /v1/completions and /v1/chat/completions
                 with damaged bodies: 200, or a 4xx with an OpenAI error body (its `param`
                 set unless the body is not a JSON object); never a 5xx. (The official
                 client's requests against real processes: tests/fuzz/test_openai_fuzz.py.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import fuzz_input, fuzz_settings
from tests.fuzz.raw_clients import http_status
from tests.fuzz.strategies import EDGE_INTS, HUGE_INTS, NOT_UTF8, mutated, values
from tsukimi import httpd
from tsukimi.config import RouterConfig, WorkerConfig
from tsukimi.engine.tokenizer import ByteTokenizer
from tsukimi.engine.weights import load_model
from tsukimi.serving.openai.app import create_app
from tsukimi.serving.router.router import Router, WorkerSpec
from tsukimi.serving.worker.server import Worker
from tsukimi.store.master.server import MasterServer
from tsukimi.transfer.metadata import http as metadata_http
from tsukimi.transfer.metadata.http_client import HttpMetadata

FAST = RouterConfig(poll_interval_s=0.05, connect_timeout_s=1.0, read_timeout_s=10.0, startup_timeout_s=5.0)
QUERY_BYTES = st.binary(max_size=40).map(lambda b: b.replace(b" ", b"%20").replace(b"\r", b"").replace(b"\n", b""))


@st.composite
def raw_requests(
    draw: st.DrawFn, paths: list[bytes], queries: tuple[bytes, ...] = (), headers: tuple[bytes, ...] = ()
) -> bytes:
    """One HTTP/1.1 request line with fuzzed method, path and query (and sometimes a body),
    the query sometimes from `queries`, sometimes with one of the header lines `headers`."""
    method = draw(st.sampled_from([b"GET", b"GET", b"PUT", b"DELETE", b"POST", b"HEAD", b"OPTIONS", b"G\x00T"]))
    path = draw(st.one_of(st.sampled_from(paths), QUERY_BYTES.map(lambda b: b"/" + b)))
    query = draw(
        st.one_of(
            st.just(b""),
            QUERY_BYTES.map(lambda b: b"?key=" + b),
            st.sampled_from(
                [
                    b"?key=%FF%FE",
                    b"?key=%ED%A0%80",
                    b"?key=",
                    b"?key=a&key=b",
                    b"?key=" + b"x" * 70_000,
                    b"?key=%00",
                    b"?%%%",
                    b"?key=" + b"%41" * 2000,
                    b"?key=a%2Fb",
                ]
            ),
            *([st.sampled_from(queries)] if queries else []),
        )
    )
    header = draw(st.sampled_from([b"", *headers]))
    body = draw(st.binary(max_size=32))
    length = draw(st.sampled_from([str(len(body)).encode(), b"-1", b"abc", b"99999999999999999999", b"0"]))
    return (
        method
        + b" "
        + path
        + query
        + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        + header
        + b"Content-Length: "
        + length
        + b"\r\n\r\n"
        + body
    )


@pytest.fixture(scope="module")
def master_client(master: MasterServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=master.http.base_url, timeout=10.0) as client:
        yield client


@given(raw_requests([b"/query_key", b"/segments", b"/health", b"/metrics", b"/query_key/"]))
@fuzz_settings()
def test_master_http_never_answers_5xx(master: MasterServer, master_client: httpx.Client, request: bytes) -> None:
    host, port = master.http.host, master.http.port
    with fuzz_input("http-master"):
        status = http_status(host, port, request)
        assert status is None or status < 500, (status, request[:120])
        assert master_client.get("/query_key", params={"key": "nope"}).status_code == 404


@pytest.fixture(scope="module")
def metadata_server() -> Iterator[metadata_http.ServerHandle]:
    handle, _ = metadata_http.start_in_thread(max_value_bytes=1 << 16)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def metadata_client(metadata_server: metadata_http.ServerHandle) -> Iterator[HttpMetadata]:
    with HttpMetadata(metadata_server.url) as client:
        yield client


METADATA_QUERIES = (
    b"?key=k&ttl_s=1",
    b"?key=k&ttl_s=0",
    b"?key=k&ttl_s=nan",
    b"?key=k&ttl_s=1e999",
    b"?key=k&ttl_s=",
    b"?key=k&ttl_s=-5",
    b"?key=k&ttl_s=%FF",
    b"?prefix=",
    b"?prefix=k",
    b"?prefix=%FF%FE",
    b"?prefix=a&prefix=b",
    b"?prefix=" + b"p" * 2000,
)
METADATA_HEADERS = (
    b'If-Match: "1"\r\n',
    b"If-Match: 1\r\n",
    b"If-Match: *\r\n",
    b'If-Match: "0"\r\n',
    b"If-None-Match: *\r\n",
    b'If-None-Match: "1"\r\n',
    b'If-Match: "' + b"9" * 40 + b'"\r\n',
    b'If-Match: "\xd9\xa1"\r\n',
    b'If-Match: "1"\r\nIf-None-Match: *\r\n',
    b'If-Match: "1"\r\nIf-Match: "2"\r\n',
)


@given(raw_requests([b"/metadata", b"/health", b"/metadata/", b"/metadata/list"], METADATA_QUERIES, METADATA_HEADERS))
@fuzz_settings()
def test_metadata_server_never_answers_5xx(
    metadata_server: metadata_http.ServerHandle, metadata_client: HttpMetadata, request: bytes
) -> None:
    with fuzz_input("http-metadata"):
        status = http_status(metadata_server.host, metadata_server.port, request)
        assert status is None or status < 500, (status, request[:120])
        metadata_client.put("good", b"value")
        assert metadata_client.get("good") == b"value"


# -- the worker and the OpenAI router over it ----------------------------------------------------


@dataclass
class Serving:
    worker: Worker
    router: httpd.AppHandle
    worker_http: httpx.Client
    router_http: httpx.Client


@pytest.fixture(scope="module")
def serving() -> Iterator[Serving]:
    worker = Worker(WorkerConfig(name="w", model="tiny", num_blocks=64), load_model("tiny")).start()
    app = create_app(Router([WorkerSpec("w", "colocated", worker.base_url)], FAST), ByteTokenizer(), "tiny")
    router = httpd.start_in_thread(app)
    worker_http = httpx.Client(base_url=worker.base_url, timeout=30.0)
    router_http = httpx.Client(base_url=router.base_url, timeout=30.0)
    try:
        yield Serving(worker, router, worker_http, router_http)
    finally:
        worker_http.close()
        router_http.close()
        router.stop(2.0)
        worker.close()


SMALL_INTS = (-1, 0, 1, 2, 3)
NUMBERS = st.sampled_from(SMALL_INTS + EDGE_INTS + HUGE_INTS + (0.5, -0.0, 1e308, 1e-308))
# NOTE: valid max_tokens stay tiny (1..3, or past the context): generation must not dominate the budget
MAX_TOKENS = st.sampled_from((-(2**63), -1, 0, 1, 2, 3, 4097, 2**31, 2**63, 2**64, 10**30, "3", None, 1.5, True))


def json_or(draw: st.DrawFn, body: dict[str, object]) -> bytes:
    """`body` as JSON, maybe damaged: flipped bytes, a string that is not UTF-8, deep nesting."""
    raw = msgspec.json.encode(body)
    kind = draw(st.sampled_from(["json", "json", "json", "mutated", "not_utf8", "deep", "garbage", "value"]))
    if kind == "mutated":
        return draw(mutated([raw]))
    if kind == "not_utf8":
        return raw.replace(b'"', b'"' + draw(st.sampled_from(NOT_UTF8)), 1)
    if kind == "deep":
        return raw[:-1] + b', "stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    if kind == "garbage":
        return draw(st.binary(max_size=40))
    if kind == "value":  # any JSON value, mostly not an object
        return msgspec.json.encode(draw(values(4)))
    return raw


@st.composite
def generate_bodies(draw: st.DrawFn) -> bytes:
    body: dict[str, object] = {
        "request_id": draw(st.one_of(st.text(max_size=8), st.sampled_from(["", "x" * 10_000]), values(4))),
        "prompt_ids": draw(
            st.one_of(
                st.lists(st.sampled_from([0, 1, 5, 31999, 32000, -1, 2**64]), max_size=6),
                st.just(list(range(5000))),
                values(4),
            )
        ),
    }
    optional = {
        "max_tokens": MAX_TOKENS,
        "temperature": NUMBERS,
        "top_p": NUMBERS,
        "seed": NUMBERS,
        "stop_token_ids": st.lists(NUMBERS, max_size=3),
        "ignore_eos": st.one_of(st.booleans(), values(3)),
        "unknown": values(3),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=4)):
        body[name] = draw(optional[name])
    return json_or(draw, body)


def check_ndjson(response: httpx.Response) -> None:
    lines = [json.loads(line) for line in response.iter_lines() if line]
    assert lines and lines[-1]["finish_reason"] in ("stop", "length"), lines[-1:]


@given(generate_bodies())
@fuzz_settings()
def test_worker_generate_answers_4xx_or_a_finished_stream(serving: Serving, body: bytes) -> None:
    with fuzz_input("http-worker"):
        with serving.worker_http.stream("POST", "/generate", content=body) as response:
            if response.status_code == 200:
                check_ndjson(response)
            else:
                assert 400 <= response.status_code < 500, (response.status_code, response.read()[:200])
                assert "error" in json.loads(response.read())
        good = {"request_id": "good", "prompt_ids": [5, 6, 7], "max_tokens": 1}
        with serving.worker_http.stream("POST", "/generate", json=good) as response:
            assert response.status_code == 200
            check_ndjson(response)


@pytest.mark.parametrize("seed", [2**64, -1, -(2**63) - 1])
def test_regression_worker_seed_out_of_range_is_400_and_others_run_on(serving: Serving, seed: int) -> None:
    """A seed past 64 bits made torch raise on the engine thread, which failed every running
    request with a 500 and rebuilt the engine."""
    response = serving.worker_http.post("/generate", json={"request_id": "s", "prompt_ids": [5], "seed": seed})
    assert response.status_code == 400 and "seed" in response.json()["error"]["message"]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [1e-308, 1e-40])
def test_regression_worker_tiny_temperature_or_top_p_is_400(serving: Serving, field: str, value: float) -> None:
    """logits / 1e-308 overflowed to inf, and top_p 1e-308 is 0 in float32: sampling raised on
    the engine thread, which failed every running request (the router answered 502)."""
    body = {"request_id": "t", "prompt_ids": [5], field: value}
    response = serving.worker_http.post("/generate", json=body)
    assert response.status_code == 400 and field in response.json()["error"]["message"]
    response = serving.router_http.post("/v1/completions", json={"prompt": "0", field: value})
    assert response.status_code == 400, response.text


def test_regression_worker_body_not_utf8_is_400(serving: Serving) -> None:
    response = serving.worker_http.post("/generate", content=b'{"request_id": "\xff", "prompt_ids": [5]}')
    assert response.status_code == 400


def messages() -> st.SearchStrategy[object]:
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "", "x" * 1000])},
        optional={
            "content": st.one_of(
                st.text(max_size=12),
                st.none(),
                values(3),
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image"])}, optional={"text": st.text(max_size=8)}
                    ),
                    max_size=2,
                ),
            )
        },
    )
    return st.one_of(st.lists(message, max_size=3), values(3))


@st.composite
def openai_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body: dict[str, object] = (
        {"messages": draw(messages())}
        if chat
        else {
            "prompt": draw(
                st.one_of(
                    st.text(max_size=12), st.lists(st.sampled_from([5, 255, -1, 32000, 2**64]), max_size=4), values(3)
                )
            )
        }
    )
    optional = {
        "model": st.sampled_from(["tiny", "other", "", None, 3]),
        "max_tokens": MAX_TOKENS,
        "max_completion_tokens": MAX_TOKENS,
        "temperature": NUMBERS,
        "top_p": NUMBERS,
        "seed": NUMBERS,
        "n": st.sampled_from([1, 2, 0, -1, None]),
        "stream": st.one_of(st.booleans(), values(2)),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), values(3)),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), values(2)),
        "stop_token_ids": st.lists(NUMBERS, max_size=3),
        "ignore_eos": st.booleans(),
        "logprobs": values(2),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=5)):
        body[name] = draw(optional[name])
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2  # NOTE: not the chat default of 256 tokens
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, json_or(draw, body)


def _json_object(body: bytes) -> object:
    try:
        return json.loads(body, parse_constant=lambda name: 1 / 0)  # NOTE: NaN is not JSON
    except (ValueError, RecursionError, ZeroDivisionError):
        return None


@given(openai_bodies())
@fuzz_settings()
def test_openai_api_answers_4xx_or_a_completion(serving: Serving, case: tuple[str, bytes]) -> None:
    path, body = case
    with fuzz_input("http-openai"):
        response = serving.router_http.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code in (200, 400, 404), (response.status_code, response.text[:300])
        if response.status_code != 200:
            assert set(response.json()) == {"error"}
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            if isinstance(_json_object(body), dict):  # NOTE: then some parameter is at fault
                assert error["param"], (error, body[:200])
        good = serving.router_http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert good.status_code == 200, good.text
