"""One request of `tsukimi bench serve --workload overload`, and how it ended (issue 17).

The mixed workload: prompts of mixed lengths (a few token ids to a few hundred), half of them
after one of a few shared system prefixes, small `max_tokens`, streamed or not at random.
`send` never raises for HTTP or network errors and never outlives its timeout; it sorts the
request into one `Outcome` kind:

- served:   HTTP 200 and at least one token (a stream also ends with `data: [DONE]`);
- rejected: HTTP 429 or 503 whose OpenAI error body names a reason (`error.code`);
- error:    another status with a reason, or a stream that reported an error after it began;
- failed:   no answer within the timeout, a broken connection, a 5xx (or 429/503) without a
            reason, a 200 without tokens or a stream cut before `[DONE]`: what must never happen.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Literal

import h11
import numpy as np

from tsukimi.bench.overload_http import Answer, post_json

_VOCAB = (3, 250)  # NOTE: ids every tokenizer here has (as in the chat and skewed workloads)

Kind = Literal["served", "rejected", "error", "failed"]


@dataclass(frozen=True, slots=True)
class OverloadRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: Kind
    status: int  # HTTP status; 0 when none came
    reason: str  # the error's code, or what went wrong; "" when served
    stream: bool
    latency_s: float  # from sending to the end of the answer
    ttft_s: float = float("nan")  # streamed and served: the first token
    tokens: int = 0
    text: str = ""
    message: str = ""  # the error's message, when there is one


def mixed_requests(count: int, seed: int) -> list[OverloadRequest]:
    """`count` requests of the mixed workload (pure: the same for the same seed)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(*_VOCAB, 192).tolist() for _ in range(3)]
    out = []
    for _ in range(count):
        own = rng.integers(*_VOCAB, int(rng.choice((8, 32, 96, 256)))).tolist()
        shared = rng.random() < 0.5
        prompt = prefixes[int(rng.integers(len(prefixes)))] + own if shared else own
        out.append(OverloadRequest(tuple(prompt), int(rng.integers(2, 13)), bool(rng.random() < 0.5)))
    return out


async def send(url: str, model: str, request: OverloadRequest, timeout_s: float) -> Outcome:
    """Send one completion on a connection of its own and sort how it ended (see the module);
    never raises for HTTP or network errors and returns within `timeout_s` (a timeout is a failure)."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            return await _send(url, model, request, start)
    except TimeoutError:
        return Outcome("failed", 0, f"client timeout ({timeout_s:g} s)", request.stream, time.perf_counter() - start)
    except OSError as exc:
        return Outcome("failed", 0, type(exc).__name__, request.stream, time.perf_counter() - start)
    except (h11.ProtocolError, ValueError) as exc:  # NOTE: ValueError: a stream event that is not JSON
        return Outcome("failed", 200, f"malformed answer: {exc}", request.stream, time.perf_counter() - start)


async def _send(url: str, model: str, request: OverloadRequest, start: float) -> Outcome:
    body: dict[str, object] = {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": request.stream,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    async with post_json(f"{url}/v1/completions", json.dumps(body).encode()) as answer:
        if answer.status != 200:
            raw = await answer.read()
            return _refusal(answer.status, raw, request.stream, time.perf_counter() - start)
        if not request.stream:
            return _whole(await answer.read(), time.perf_counter() - start)
        return await _streamed(answer, start)


def _refusal(status: int, raw: bytes, stream: bool, latency_s: float) -> Outcome:
    """A non-200 answer: rejected (429/503 with a reason), error (another status with one) or failed."""
    code, message = _error_of(raw)
    if not code:
        return Outcome("failed", status, f"HTTP {status} without a reason: {raw[:120]!r}", stream, latency_s)
    kind: Kind = "rejected" if status in (429, 503) else "error"
    return Outcome(kind, status, code, stream, latency_s, message=message)


def _error_of(raw: bytes) -> tuple[str, str]:
    """(`error.code`, `error.message`) of an OpenAI error body ("" when there is none)."""
    try:
        error = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError):
        return "", ""
    if not isinstance(error, dict):
        return "", ""
    return str(error.get("code") or ""), str(error.get("message") or "")[:300]


def _whole(raw: bytes, latency_s: float) -> Outcome:
    try:
        answer = json.loads(raw)
        tokens, text = int(answer["usage"]["completion_tokens"]), str(answer["choices"][0]["text"])
    except (ValueError, KeyError, IndexError, TypeError):
        return Outcome("failed", 200, f"malformed body: {raw[:120]!r}", False, latency_s)
    if tokens < 1:
        return Outcome("failed", 200, "no tokens", False, latency_s)
    return Outcome("served", 200, "", False, latency_s, tokens=tokens, text=text)


async def _streamed(answer: Answer, start: float) -> Outcome:
    """A 200 stream: served once `[DONE]` came after at least one token."""
    first, tokens, parts, done, error, message = float("nan"), 0, [], False, "", ""
    async for line in answer.lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            code, message = _error_of(line[6:].encode())
            error = code or "stream error without a reason"
            continue
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                first = first if first == first else time.perf_counter() - start
                parts.append(choice["text"])
        tokens = int((chunk.get("usage") or {}).get("completion_tokens", tokens))
    latency = time.perf_counter() - start
    if error:
        return Outcome("error", 200, f"in stream: {error}", True, latency, message=message)
    if not done or tokens < 1:
        return Outcome("failed", 200, "stream cut before [DONE]" if not done else "no tokens", True, latency)
    return Outcome("served", 200, "", True, latency, first, tokens, "".join(parts))
