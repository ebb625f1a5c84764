"""Fuzzing the OpenAI API through the official `openai` client, against real processes: a
`tsukimi router` process over a prefill and a decode worker process (tiny model, a store in
this process), as a deployment runs it.

Targets:
  openai-valid   requests the client builds from valid values of every parameter it takes
                 (and vLLM's extensions in extra_body): each one succeeds, streamed or not.
  openai-mixed   the same with each parameter sometimes wrong (wrong JSON types, huge and
                 negative numbers, out-of-vocabulary ids, unsupported values, empty and too
                 long prompts, batches): each is a success or a 4xx whose OpenAI error body
                 names the parameter (`param`) and no worker; never a 5xx.

The raw-bytes garbage (not JSON, not UTF-8, deep nesting) is `http-openai` in test_http_fuzz.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ_EXAMPLES, fuzz_input, fuzz_settings
from tsukimi.bench.up_cluster import planned, serving_settings
from tsukimi.serving.cluster.launcher import LaunchedCluster, with_args

WORKERS = ("prefill-0", "decode-0")
VOCAB = 32000
EXAMPLES = max(10, FUZZ_EXAMPLES // 2)  # NOTE: each valid example generates tokens on the real engine


@dataclass
class Deployment:
    client: openai.OpenAI
    base_url: str


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`tsukimi up`'s PD cluster of the tiny model (master, a prefill and a decode worker, the
    router admitting everything), launched as `tsukimi up` launches it."""
    settings = serving_settings("tiny", "pd", num_blocks=256, extra=[f"workers.segment_bytes={16 << 20}"])
    groups, launch = planned(settings, tmp_path_factory.mktemp("cluster"))
    cluster = LaunchedCluster(with_args(groups, "router", "--set", "conductor.rejection=none"), launch)
    with cluster, openai.OpenAI(base_url=cluster.api + "/v1", api_key="none", timeout=30.0, max_retries=0) as client:
        yield Deployment(client, cluster.api)


# -- strategies: each parameter's valid values, and (mixed) its wrong ones -----------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
WRONG = st.sampled_from(
    [None, True, "x", "", -1, 0, 2**63, 2**64, -(2**64), 10**30, 1e308, -1e-308, 0.5, [], [1, "a"], {}, {"a": [1]}]
)
VALID: dict[str, st.SearchStrategy[object]] = {
    "max_tokens": st.integers(1, 3),
    "temperature": st.sampled_from([0, 0.0, 1e-6, 0.7, 1, 2]),
    "top_p": st.sampled_from([1e-6, 0.5, 1, 1.0]),
    "seed": st.sampled_from([0, 1, 2**63 - 1]),
    "stop": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=4)),
    "n": st.just(1),
    "user": TEXT,
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0),
    "logit_bias": st.just({}),
}
BAD: dict[str, st.SearchStrategy[object]] = {
    "max_tokens": st.sampled_from([0, -1, 5000, 10**9, 2**64]),
    "temperature": st.sampled_from([-0.5, 2.01, 1e-9, 1e-308, 100]),
    "top_p": st.sampled_from([0, -1, 1.5, 1e-308]),
    "seed": st.sampled_from([-1, 2**63, 2**64]),
    "stop": st.sampled_from([[""], ["a"] * 5, ["x" * 2000], ""]),
    "n": st.sampled_from([0, 2, -1]),
    "user": st.just(3),
    "presence_penalty": st.sampled_from([0.5, -2]),
    "frequency_penalty": st.sampled_from([1, 2.5]),
    "logit_bias": st.sampled_from([{"5": 10}, {"x": "y"}]),
}
EXTRA_VALID: dict[str, st.SearchStrategy[object]] = {
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "some_client_extension": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
}
EXTRA_BAD: dict[str, st.SearchStrategy[object]] = {
    "ignore_eos": st.sampled_from(["yes", 1]),
    "stop_token_ids": st.sampled_from([[VOCAB], [-1], list(range(65)), ["a"]]),
    "top_k": st.sampled_from([5, 40]),
    "min_tokens": st.just(2),
}


def _params(
    draw: st.DrawFn, bad: bool, valid: dict[str, st.SearchStrategy[object]], wrong: dict[str, st.SearchStrategy[object]]
) -> dict[str, object]:
    """Some of the parameters: valid values, or (when `bad`) sometimes wrong ones."""
    out = {}
    for name in draw(st.lists(st.sampled_from(sorted(valid)), unique=True, max_size=5)):
        kind = draw(st.sampled_from(["valid", "valid", "valid", "bad", "wrong_type"])) if bad else "valid"
        strategy = valid[name] if kind == "valid" else (wrong.get(name, WRONG) if kind == "bad" else WRONG)
        out[name] = draw(strategy)
    if bad and draw(st.integers(0, 3)) == 3:
        name = draw(st.sampled_from(sorted(wrong)))
        out[name] = draw(wrong[name])
    return out


@st.composite
def prompts(draw: st.DrawFn, bad: bool) -> object:
    good = [TEXT, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), TEXT.map(lambda t: [t])]
    wrong = [st.sampled_from(["", [], [VOCAB], [-1], ["a", "b"], [[1], [2]], "x" * 5000, [1, "a"]]), WRONG]
    return draw(st.one_of(*good, *(wrong if bad and draw(st.integers(0, 2)) == 2 else [])))


@st.composite
def messages(draw: st.DrawFn, bad: bool) -> object:
    role = st.sampled_from(["system", "developer", "user", "assistant"])
    part = st.builds(lambda t: {"type": "text", "text": t}, TEXT)
    content = st.one_of(TEXT, st.lists(part, min_size=1, max_size=2))
    message = st.fixed_dictionaries({"role": role, "content": content})
    good = st.lists(message, min_size=1, max_size=3).map(lambda m: [*m, {"role": "user", "content": "hi"}])
    if not (bad and draw(st.integers(0, 2)) == 2):
        return draw(good)
    broken = st.sampled_from(
        [
            [],
            [{"role": "tool", "content": "x", "tool_call_id": "1"}],
            [{"role": "user"}],
            [{"content": "x"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            [{"role": "user", "content": "x" * 5000}],
            [{"role": "user", "content": 3}],
            "hi",
        ]
    )
    return draw(st.one_of(broken, WRONG))


@st.composite
def requests(draw: st.DrawFn, bad: bool) -> tuple[bool, dict[str, object]]:
    """(chat, keyword arguments of client.(chat.)completions.create)."""
    chat = draw(st.booleans())
    kwargs: dict[str, object] = {"model": "tiny", "max_tokens": 2, **_params(draw, bad, VALID, BAD)}
    if bad and draw(st.integers(0, 9)) == 9:
        kwargs["model"] = draw(st.sampled_from(["gpt-4o", ""]))
    if chat:
        kwargs["messages"] = draw(messages(bad))
        if draw(st.booleans()):
            kwargs["max_completion_tokens"] = kwargs.pop("max_tokens")
        unsupported = {
            "response_format": {"type": "json_object"},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "logprobs": True,
            "top_logprobs": 2,
        }
    else:
        kwargs["prompt"] = draw(prompts(bad))
        unsupported = {"logprobs": 1, "echo": True, "best_of": 2, "suffix": "x"}
    if bad and draw(st.integers(0, 4)) == 4:
        name = draw(st.sampled_from(sorted(unsupported)))
        kwargs[name] = unsupported[name]
    kwargs["stream"] = draw(st.booleans())
    if kwargs["stream"] and draw(st.booleans()):
        kwargs["stream_options"] = {"include_usage": draw(st.booleans())}
    elif bad and draw(st.integers(0, 9)) == 9:
        kwargs["stream_options"] = {"include_usage": True}  # only allowed with stream
    kwargs["extra_body"] = _params(draw, bad, EXTRA_VALID, EXTRA_BAD)
    return chat, kwargs


def _call(client: openai.OpenAI, chat: bool, kwargs: dict[str, object]) -> None:
    """Sends the request; reads a stream to its end."""
    api = client.chat.completions if chat else client.completions
    result = api.create(**kwargs)  # type: ignore[call-overload]
    if kwargs["stream"]:
        chunks = list(result)
        assert chunks, kwargs
    else:
        assert result.choices and result.usage is not None, result
        # NOTE: a sampled first token may be EOS: the engine emits no stop token, so an
        # immediate stop is 0 completion tokens with finish_reason "stop" (seen once in CI)
        stopped_at_once = result.choices[0].finish_reason == "stop" and result.usage.completion_tokens == 0
        assert result.usage.completion_tokens >= 1 or stopped_at_once, result


@given(requests(bad=False))
@fuzz_settings(EXAMPLES)
def test_valid_requests_from_the_openai_client_succeed(
    deployment: Deployment, case: tuple[bool, dict[str, object]]
) -> None:
    chat, kwargs = case
    with fuzz_input("openai-valid"):
        _call(deployment.client, chat, kwargs)


@given(requests(bad=True))
@fuzz_settings(EXAMPLES)
def test_any_request_from_the_openai_client_is_served_or_a_4xx_naming_the_param(
    deployment: Deployment, case: tuple[bool, dict[str, object]]
) -> None:
    chat, kwargs = case
    with fuzz_input("openai-mixed"):
        try:
            _call(deployment.client, chat, kwargs)
            event("200")
        except openai.APIStatusError as exc:
            event(f"{exc.status_code} {exc.response.json()['error']['param']}")
            assert 400 <= exc.status_code < 500, (exc.status_code, exc.response.text[:300], kwargs)
            error = exc.response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert isinstance(error["param"], str) and error["param"], (error, kwargs)
            assert not any(name in error["message"] for name in WORKERS), error
