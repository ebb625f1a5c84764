"""The OpenAI API's wire shapes: the request bodies of /v1/completions and
/v1/chat/completions (msgspec; unknown fields ignored, as vLLM does), the usage block, error
bodies (with the offending parameter, `InvalidArgument.param`), the server-sent-event
framing and the `X-Request-Id` header every completion's answer carries. No logic beyond
building them.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from fastapi import Response

from tsukimi.errors import InvalidArgument, Rejected, TsukimiError
from tsukimi.serving.protocol import http_status

REQUEST_ID_HEADER = "X-Request-Id"  # on every answer to a completion: the client's id, else the router's


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct, frozen=True):
    type: str


class Params(msgspec.Struct, frozen=True, kw_only=True):
    """The fields both endpoints take. Types only: the values are checked in
    tsukimi/serving/openai/validation.py. Fields of OpenAI's API (and vLLM's sampling
    extensions) that tsukimi does not implement are declared so that a request using them gets
    a 400 naming the parameter instead of being served as if they were not there; fields no
    one declares are ignored (as vLLM does: clients add their own extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the operator's logs: accepted, unused
    ignore_eos: bool = False  # vLLM's extensions
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # each choice carries its token ids too
    # NOTE: not implemented: a 400 unless the value is the default (openai_validation.UNSUPPORTED)
    logprobs: bool | int | None = None  # completions: a count; chat: a flag
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None  # vLLM's sampling extensions
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None


class CompletionRequest(Params, frozen=True, kw_only=True):
    prompt: str | list[int | str | list[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # a participant's name: accepted, unused (the templates have no place for it)
    tool_calls: list[dict[str, object]] | None = None


class ChatRequest(Params, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None  # meaningless without tools: accepted, unused
    functions: list[dict[str, object]] | None = None
    function_call: str | dict[str, object] | None = None


@dataclass(slots=True)
class Usage:
    """A response's usage block. Its body has OpenAI's fields only: the router's diagnostics
    (`pool_tokens`, counted here for the metrics; what its prefix index expected) are in its
    decision log (`GET /decisions`, tsukimi/serving/router/decision_log.py), keyed by the
    request id."""

    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    pool_tokens: int = 0

    def body(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def delta_choice(delta: dict[str, str], finish: str | None) -> dict[str, object]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def sse_event(body: dict[str, object]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def json_response(body: dict[str, object], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error_body(exc: TsukimiError) -> tuple[int, dict[str, object]]:
    """The HTTP status (the serving protocol's one table) and OpenAI error body for `exc`.
    The code is the error's own (the Conductor's reason for a rejection). Pure."""
    status = http_status(exc)
    kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
    code = exc.reason if isinstance(exc, Rejected) else exc.code
    param = exc.param if isinstance(exc, InvalidArgument) else None
    return status, {"error": {"message": str(exc), "type": kind, "param": param, "code": code}}


def outcome_of(status: int) -> str:
    outcomes = {
        400: "bad_request",
        404: "bad_request",
        409: "bad_request",
        429: "rejected",
        502: "worker_error",
        503: "unavailable",
    }
    return outcomes.get(status, "error")
