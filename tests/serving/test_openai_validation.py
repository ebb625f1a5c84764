"""Every OpenAI parameter's bad values at the API boundary: a table of (endpoint, body) ->
(HTTP status, param, code), answered with an OpenAI error body by the router app over a FAKE
worker (tests/serving/test_router.py) that is never contacted; the good values of the same
parameters are served. Also the pure pieces: msgspec's paths become `param`, the model's
context comes from its spec.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.serving.fakes import FAST, FakeWorker, close_all
from tsukimi import httpd
from tsukimi.engine.tokenizer import ByteTokenizer
from tsukimi.errors import ConfigError, InvalidArgument
from tsukimi.serving.openai.app import create_app
from tsukimi.serving.openai.validation import ModelLimits, RequestChecker, decode_body, model_context_tokens
from tsukimi.serving.router.router import Router

CONTEXT = 4096  # the tiny model's
USER = [{"role": "user", "content": "hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"


def chat(**fields: object) -> dict[str, object]:
    return {"messages": USER, "max_tokens": 2, **fields}


def comp(**fields: object) -> dict[str, object]:
    return {"prompt": "abc", "max_tokens": 2, **fields}


def message(**fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", **fields}], "max_tokens": 2}


# fmt: off
# (path, body (bytes: sent as is), status, param, code)
BAD: list[tuple[str, dict[str, object] | bytes, int, str | None, str]] = [
    (C, comp(model="gpt-9"), 404, "model", "model_not_found"),
    (C, comp(model=3), 400, "model", "invalid_argument"),
    (CHAT, chat(model=""), 404, "model", "model_not_found"),
    (C, {"max_tokens": 2}, 400, "prompt", "invalid_argument"),
    (C, comp(prompt=3), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=None), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=""), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=[]), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=[[]]), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=[5, 32000]), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=[-1]), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=[2**64]), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=["a", "b"]), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=[[5], [6]]), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=[5, "a"]), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=[[5, "a"]]), 400, "prompt[0][1]", "invalid_argument"),
    (C, comp(prompt={"text": "a"}), 400, "prompt", "invalid_argument"),
    (C, comp(prompt=1.5), 400, "prompt", "invalid_argument"),
    (C, comp(prompt="x" * CONTEXT), 400, "prompt", "invalid_argument"),
    (C, comp(prompt="x" * 4000, max_tokens=200), 400, "max_tokens", "invalid_argument"),
    (C, comp(prompt=[5] * (CONTEXT - 1), max_tokens=2), 400, "max_tokens", "invalid_argument"),
    *[(C, comp(max_tokens=v), 400, "max_tokens", "invalid_argument")
      for v in (0, -1, 10**9, 2**64, -(2**64), 1.5, "3", True, [], {})],
    (CHAT, chat(max_tokens=10**9), 400, "max_tokens", "invalid_argument"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", "invalid_argument"),
    (CHAT, chat(max_completion_tokens=10**9), 400, "max_completion_tokens", "invalid_argument"),
    (CHAT, chat(max_completion_tokens="1"), 400, "max_completion_tokens", "invalid_argument"),
    *[(C, comp(temperature=v), 400, "temperature", "invalid_argument")
      for v in (-0.1, 2.5, 1e-9, 1e-308, "1", True, [1])],
    (C, b'{"prompt": "a", "temperature": 1e999}', 400, "temperature", "invalid_argument"),
    *[(C, comp(top_p=v), 400, "top_p", "invalid_argument") for v in (0, -1, 1.5, 1e-308, "1")],
    *[(C, comp(n=v), 400, "n", "invalid_argument") for v in (2, 0, -1, "1", 1.0)],
    *[(C, comp(stop=v), 400, "stop", "invalid_argument")
      for v in (3, ["a"] * 5, [""], "", ["x" * 2000], {"a": 1})],
    (C, comp(stop=[1]), 400, "stop[0]", "invalid_argument"),
    (CHAT, chat(stop=["a", None]), 400, "stop[1]", "invalid_argument"),
    *[(C, comp(stop_token_ids=v), 400, "stop_token_ids", "invalid_argument")
      for v in ([32000], [-1], list(range(65)), "1", 1)],
    (C, comp(stop_token_ids=[1.5]), 400, "stop_token_ids[0]", "invalid_argument"),
    *[(C, comp(seed=v), 400, "seed", "invalid_argument") for v in (-1, 2**63, 2**64, -(2**63) - 1, 1.5, "1")],
    *[(C, comp(ignore_eos=v), 400, "ignore_eos", "invalid_argument") for v in ("yes", 1, None)],
    *[(C, comp(stream=v), 400, "stream", "invalid_argument") for v in ("true", 1, [])],
    (C, comp(stream_options={"include_usage": True}), 400, "stream_options", "invalid_argument"),
    (C, comp(stream=False, stream_options={}), 400, "stream_options", "invalid_argument"),
    (C, comp(stream=True, stream_options=3), 400, "stream_options", "invalid_argument"),
    (CHAT, chat(stream=True, stream_options={"include_usage": "x"}), 400, "stream_options.include_usage",
     "invalid_argument"),
    (C, comp(user=3), 400, "user", "invalid_argument"),
    *[(C, comp(**{name: value}), 400, name, "invalid_argument") for name, value in [
        ("logprobs", 1), ("logprobs", 0), ("logprobs", True), ("echo", True), ("best_of", 2), ("suffix", "x"),
        ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"5": 1}), ("top_k", 5),
        ("min_p", 0.1), ("repetition_penalty", 1.2), ("min_tokens", 3), ("logprobs", "x"), ("echo", 1),
        ("logit_bias", []),
    ]],
    (C, comp(logit_bias={"5": "x"}), 400, "logit_bias", "invalid_argument"),
    *[(CHAT, chat(**{name: value}), 400, name, "invalid_argument") for name, value in [
        ("logprobs", True), ("top_logprobs", 2), ("response_format", {"type": "json_object"}),
        ("response_format", "json"), ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "required"), ("tool_choice", {"type": "function"}), ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}), ("parallel_tool_calls", "yes"),
    ]],
    (CHAT, {"max_tokens": 2}, 400, "messages", "invalid_argument"),
    (CHAT, chat(messages=[]), 400, "messages", "invalid_argument"),
    (CHAT, chat(messages="hi"), 400, "messages", "invalid_argument"),
    (CHAT, chat(messages=[3]), 400, "messages[0]", "invalid_argument"),
    (CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role", "invalid_argument"),
    (CHAT, message(role="tool", content="x"), 400, "messages[0].role", "invalid_argument"),
    (CHAT, chat(messages=[*USER, {"role": "robot", "content": "x"}]), 400, "messages[1].role", "invalid_argument"),
    (CHAT, message(role=3, content="x"), 400, "messages[0].role", "invalid_argument"),
    (CHAT, message(), 400, "messages[0].content", "invalid_argument"),
    (CHAT, message(content=3), 400, "messages[0].content", "invalid_argument"),
    (CHAT, message(content=[{"type": "image_url", "image_url": {"url": "x"}}]), 400, "messages[0].content[0].type",
     "invalid_argument"),
    (CHAT, message(content=[{"type": "text"}]), 400, "messages[0].content[0].text", "invalid_argument"),
    (CHAT, message(content=[{"text": "a"}]), 400, "messages[0].content[0].type", "invalid_argument"),
    (CHAT, message(content=[{"type": "text", "text": 3}]), 400, "messages[0].content[0].text", "invalid_argument"),
    (CHAT, message(content="x", name=3), 400, "messages[0].name", "invalid_argument"),
    (CHAT, message(content="x", tool_calls=[{"id": "1"}]), 400, "messages[0].tool_calls", "invalid_argument"),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * CONTEXT}]), 400, "messages", "invalid_argument"),
    (C, b"{", 400, None, "invalid_argument"),
    (C, b"", 400, None, "invalid_argument"),
    (C, b"[]", 400, None, "invalid_argument"),
    (C, b'"prompt"', 400, None, "invalid_argument"),
    (C, b'{"prompt": "\xff"}', 400, None, "invalid_argument"),
    (C, b'{"prompt": "\\ud800"}', 400, None, "invalid_argument"),
    (C, b'{"prompt": "a", "stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "stop[0]", "invalid_argument"),
    (C, b'{"prompt": "a", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None, "invalid_argument"),
]

GOOD: list[tuple[str, dict[str, object]]] = [
    (C, comp(model="tiny", prompt=["abc"])),
    (C, comp(prompt=[[5, 6]])),
    (C, comp(prompt=[5, 6, 7], stop_token_ids=[31999], seed=2**63 - 1, temperature=0, top_p=1e-6)),
    (C, comp(prompt="x" * 4000)),  # NOTE: the default max_tokens is cut to what the context leaves
    (C, comp(prompt="x" * 4090, max_tokens=None)),
    (C, comp(temperature=2, top_p=0.5, n=1, stop=["zz", "yy", "x", "w"], user="u", ignore_eos=True)),
    (C, comp(logprobs=None, echo=False, best_of=1, suffix="", presence_penalty=0, frequency_penalty=0.0,
             logit_bias={}, top_k=-1, min_p=0, repetition_penalty=1, min_tokens=0)),
    (C, comp(stream=True, stream_options={"include_usage": True})),
    (C, comp(unknown_field={"deep": [1, 2]}, metadata={"a": "b"})),
    (CHAT, chat(max_tokens=None, max_completion_tokens=3)),
    (CHAT, chat(logprobs=False, top_logprobs=0, response_format={"type": "text"}, tools=[], tool_choice="none",
                parallel_tool_calls=True, functions=[], function_call="auto")),
    (CHAT, chat(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": None}, {"role": "user", "content": ""}])),
    (CHAT, chat(stream=True, stream_options={"include_usage": False}, stop="\n")),
]
# fmt: on


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[httpx.Client, FakeWorker]]:
    fake = FakeWorker("decode-0")
    handle: httpd.AppHandle = httpd.start_in_thread(create_app(Router([fake.spec], FAST), ByteTokenizer(), "tiny"))
    with httpx.Client(base_url=handle.base_url, timeout=30.0) as client:
        yield client, fake
    close_all([lambda: handle.stop(2.0), fake.close])


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD)
def test_bad_parameter_is_an_openai_error_and_no_worker_is_contacted(
    api: tuple[httpx.Client, FakeWorker],
    path: str,
    body: dict[str, object] | bytes,
    status: int,
    param: str | None,
    code: str,
) -> None:
    client, fake = api
    fake.configure()
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "param": param,
            "code": code,
            "type": "invalid_request_error",
        }
    }
    message = response.json()["error"]["message"]
    assert "decode-0" not in message and "$." not in message and "`$`" not in message, message
    assert fake.calls == []


@pytest.mark.parametrize(("path", "body"), GOOD)
def test_good_values_of_the_same_parameters_are_served(
    api: tuple[httpx.Client, FakeWorker], path: str, body: dict[str, object]
) -> None:
    client, fake = api
    fake.configure()
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert len(fake.calls) == 1


def test_the_worker_gets_the_checked_values(api: tuple[httpx.Client, FakeWorker]) -> None:
    client, fake = api
    fake.configure()
    body = comp(prompt="x" * 4090, max_tokens=None, temperature=0.5, top_p=0.9, seed=7, stop_token_ids=[9])
    assert client.post(C, json={**body, "ignore_eos": True}).status_code == 200
    call = fake.calls[0]
    assert (call["max_tokens"], call["temperature"], call["top_p"], call["seed"]) == (6, 0.5, 0.9, 7)
    assert (call["stop_token_ids"], call["ignore_eos"], len(call["prompt_ids"])) == ([9], True, 4090)  # type: ignore[arg-type]


def test_a_worker_refusal_reaches_the_client_without_the_worker_name() -> None:
    """What a worker still refuses (its checks stay, for other callers) is answered with its
    error class and message, never "worker decode-0 ...": the client's fault names no worker."""
    fake = FakeWorker("decode-0", status=400)
    handle: httpd.AppHandle = httpd.start_in_thread(create_app(Router([fake.spec], FAST), ByteTokenizer(), "tiny"))
    try:
        with httpx.Client(base_url=handle.base_url, timeout=30.0) as client:
            for stream in (False, True):
                response = client.post(C, json=comp(stream=stream))
                assert response.status_code == 400 and response.json()["error"]["message"] == "scripted 400"
    finally:
        close_all([lambda: handle.stop(2.0), fake.close])


def test_msgspec_paths_become_params() -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_body(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}', chat=True)
    assert info.value.param == "messages[0].content[0].text"
    assert str(info.value) == "invalid value for 'messages[0].content[0].text': Expected `str | null`, got `int`"
    with pytest.raises(InvalidArgument) as info:
        decode_body(b'{"messages": [{}]}', chat=True)
    assert info.value.param == "messages[0].role"


def test_checker_without_http() -> None:
    checker = RequestChecker(ByteTokenizer(), "tiny", ModelLimits(32000, 20), 256)
    assert checker.check(b'{"prompt": "abcd"}', chat=False).max_tokens == 16
    assert checker.check(b'{"prompt": "' + b"a" * 10 + b'"}', chat=False).max_tokens == 10
    with pytest.raises(InvalidArgument) as info:
        checker.check(b'{"prompt": "abcd", "max_tokens": 17}', chat=False)
    assert info.value.param == "max_tokens" and "context is 20 tokens" in str(info.value)
    big = RequestChecker(ByteTokenizer(), "tiny", ModelLimits(32000, 10**6), 256)
    with pytest.raises(InvalidArgument) as info:
        big.check(b'{"prompt": "abcd", "max_tokens": 100000}', chat=False)
    assert info.value.param == "max_tokens" and "at most 65536" in str(info.value)


def test_model_context_tokens_from_the_spec() -> None:
    assert model_context_tokens("tiny") == model_context_tokens("tiny:3") == CONTEXT
    with pytest.raises(ConfigError):
        model_context_tokens("gpt-9")
