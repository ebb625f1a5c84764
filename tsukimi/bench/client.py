"""THE streaming OpenAI client of every bench: one `POST /v1/completions` on a connection of its
own (h11 over asyncio streams), bounded by a timeout, never raising for HTTP or network errors.

    result = await complete(url, model, CompletionRequest(prompt, max_tokens, request_id="r-7"))
    result.kind        served | rejected | error | failed (below)
    result.ttft_s      first streamed token;  result.token_times_s: every token chunk (TBT)
    result.token_ids   what the server returned with `return_token_ids` (vLLM)
    result.text, result.completion_tokens, result.prompt_tokens, result.cached_tokens
    result.request_id  the answer's `X-Request-Id` (the router's key to its decision records)

How a request ended:
- served:   HTTP 200 and at least one token (a stream also ends with `data: [DONE]`);
- rejected: HTTP 429 or 503 whose OpenAI error body names a reason (`error.code`);
- error:    another status with a reason, or a stream that reported an error after it began;
- failed:   no answer within the timeout, a broken connection, a 5xx (or 429/503) without a
            reason, a 200 without tokens or a stream cut before `[DONE]`: what must never happen.

Why not httpx: its connection pool (httpcore 1.0) scans every queued request against every
connection each time one is assigned, so with a thousand requests in flight the overload
generator spent its CPU there and fell minutes behind an open-loop schedule (seen at 4x
overload, 60 s). An open loop must send each request at its time whatever the others do; a
fresh loopback connection per request costs a connect, and no pool can queue a request on the
client side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import h11

Kind = Literal["served", "rejected", "error", "failed"]
REQUEST_ID_HEADER = "X-Request-Id"
_READ_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One greedy completion of token ids. `request_id` "" sends no `X-Request-Id` (the server
    makes one up); `ignore_eos` and `return_token_ids` are vLLM's (tsukimi's router takes
    `ignore_eos` too)."""

    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool = True
    request_id: str = ""
    ignore_eos: bool = False
    return_token_ids: bool = False

    def body(self, model: str) -> bytes:
        """The JSON body (pure)."""
        body: dict[str, object] = {
            "model": model,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.return_token_ids:
            body["return_token_ids"] = True
        return json.dumps(body).encode()


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """How one completion ended (see the module). Times are seconds from sending;
    `token_times_s`: when each streamed chunk with a token arrived (empty when not streamed)."""

    kind: Kind
    status: int  # HTTP status; 0 when none came
    reason: str  # the error's code, or what went wrong; "" when served
    stream: bool
    latency_s: float  # to the end of the answer
    message: str = ""  # the error's message, when there is one
    request_id: str = ""  # the answer's X-Request-Id ("" when none came)
    token_times_s: tuple[float, ...] = ()
    token_ids: tuple[int, ...] = ()
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        """Time to the first streamed token (NaN when not streamed or none came)."""
        return self.token_times_s[0] if self.token_times_s else float("nan")

    @property
    def tbt_s(self) -> float:
        """The mean gap between streamed tokens after the first (NaN with fewer than two)."""
        times = self.token_times_s
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


async def complete(url: str, model: str, request: CompletionRequest, timeout_s: float) -> CompletionResult:
    """Send `request` to `url`/v1/completions on a connection of its own and sort how it ended
    (see the module); never raises for HTTP or network errors, and returns within `timeout_s`
    (a timeout is a failure)."""
    start = time.perf_counter()

    def failed(status: int, reason: str) -> CompletionResult:
        return CompletionResult("failed", status, reason, request.stream, time.perf_counter() - start)

    try:
        async with asyncio.timeout(timeout_s):
            return await _complete(url, model, request, start)
    except TimeoutError:
        return failed(0, f"client timeout ({timeout_s:g} s)")
    except OSError as exc:
        return failed(0, type(exc).__name__)
    except (h11.ProtocolError, ValueError) as exc:  # NOTE: ValueError: a stream event that is not JSON
        return failed(200, f"malformed answer: {exc}")


async def _complete(url: str, model: str, request: CompletionRequest, start: float) -> CompletionResult:
    headers = [(REQUEST_ID_HEADER, request.request_id)] if request.request_id else []
    async with post_json(f"{url}/v1/completions", request.body(model), headers) as answer:
        if answer.status != 200:
            raw = await answer.read()
            return _refusal(answer, raw, request.stream, time.perf_counter() - start)
        if not request.stream:
            return _whole(answer, await answer.read(), time.perf_counter() - start)
        return await _streamed(answer, start)


def _refusal(answer: Answer, raw: bytes, stream: bool, latency_s: float) -> CompletionResult:
    """A non-200 answer: rejected (429/503 with a reason), error (another status with one) or failed."""
    code, message = error_of(raw)
    status, rid = answer.status, answer.request_id
    if not code:
        reason = f"HTTP {status} without a reason: {raw[:120]!r}"
        return CompletionResult("failed", status, reason, stream, latency_s, request_id=rid)
    kind: Kind = "rejected" if status in (429, 503) else "error"
    return CompletionResult(kind, status, code, stream, latency_s, message, rid)


def error_of(raw: bytes) -> tuple[str, str]:
    """(`error.code`, `error.message`) of an OpenAI error body ("" when there is none). Pure."""
    try:
        error = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError):
        return "", ""
    if not isinstance(error, dict):
        return "", ""
    return str(error.get("code") or ""), str(error.get("message") or "")[:300]


def _whole(answer: Answer, raw: bytes, latency_s: float) -> CompletionResult:
    rid = answer.request_id
    try:
        body = json.loads(raw)
        usage, choice = body["usage"], body["choices"][0]
        tokens, text = int(usage["completion_tokens"]), str(choice["text"])
        prompt, cached = _usage_counts(usage)
        ids = tuple(int(i) for i in choice.get("token_ids") or ())
    except (ValueError, KeyError, IndexError, TypeError):
        return CompletionResult("failed", 200, f"malformed body: {raw[:120]!r}", False, latency_s, request_id=rid)
    if tokens < 1:
        return CompletionResult("failed", 200, "no tokens", False, latency_s, request_id=rid)
    return CompletionResult(
        "served",
        200,
        "",
        False,
        latency_s,
        request_id=rid,
        token_ids=ids,
        text=text,
        completion_tokens=tokens,
        prompt_tokens=prompt,
        cached_tokens=cached,
    )


@dataclass(slots=True)
class _Stream:
    """What a 200 stream brought so far (mutable while it is read)."""

    times: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    message: str = ""

    def add(self, chunk: dict[str, object], at_s: float) -> None:
        """One `data:` event (mutates)."""
        if "error" in chunk:
            code, self.message = error_of(json.dumps(chunk).encode())
            self.error = code or "stream error without a reason"
            return
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                raise ValueError(f"a choice that is not an object: {choice!r}")
            ids, text = choice.get("token_ids") or [], choice.get("text") or ""
            if ids or text:
                self.times.append(at_s)
                self.ids += [int(i) for i in ids]
                self.parts.append(str(text))
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage:
            self.completion_tokens = int(usage.get("completion_tokens") or self.completion_tokens)
            self.prompt_tokens, self.cached_tokens = _usage_counts(usage)


async def _streamed(answer: Answer, start: float) -> CompletionResult:
    """A 200 stream: served once `[DONE]` came after at least one token."""
    got, done = _Stream(), False
    async for line in answer.lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if not isinstance(chunk, dict):
            raise ValueError(f"an event that is not an object: {line[:120]!r}")
        got.add(chunk, time.perf_counter() - start)
    latency, rid = time.perf_counter() - start, answer.request_id
    tokens = got.completion_tokens or len(got.times)
    if got.error:
        return CompletionResult("error", 200, f"in stream: {got.error}", True, latency, got.message, rid)
    if not done or tokens < 1:
        reason = "stream cut before [DONE]" if not done else "no tokens"
        return CompletionResult("failed", 200, reason, True, latency, request_id=rid)
    return CompletionResult(
        "served",
        200,
        "",
        True,
        latency,
        request_id=rid,
        token_times_s=tuple(got.times),
        token_ids=tuple(got.ids),
        text="".join(got.parts),
        completion_tokens=tokens,
        prompt_tokens=got.prompt_tokens,
        cached_tokens=got.cached_tokens,
    )


def _usage_counts(usage: dict[str, object]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of an OpenAI `usage` object (0 when absent)."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return int(str(usage.get("prompt_tokens") or 0)), int(str(cached or 0))


@dataclass(slots=True)
class Answer:
    """An HTTP response whose body is read from its connection as it arrives."""

    status: int
    request_id: str  # its X-Request-Id header ("" when absent)
    _conn: h11.Connection
    _reader: asyncio.StreamReader

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they come, until the response ends.

        Raises: h11.ProtocolError on a malformed response or one cut short; OSError."""
        while True:
            event = await _next_event(self._conn, self._reader)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (server-sent events), decoded as UTF-8, without their line ends."""
        pending = b""
        async for chunk in self.chunks():
            *complete_lines, pending = (pending + chunk).split(b"\n")
            for line in complete_lines:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.decode("utf-8", errors="replace")


@contextlib.asynccontextmanager
async def post_json(url: str, body: bytes, headers: list[tuple[str, str]] | None = None) -> AsyncIterator[Answer]:
    """POST `body` (JSON) to `url` on a connection of its own; the response once its head came.
    The connection is closed on the way out. No timeout here: the caller bounds the whole call.

    Raises: OSError (refused, reset), h11.ProtocolError (a malformed or cut response)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=_READ_BYTES)
    try:
        conn = h11.Connection(h11.CLIENT)
        head = [
            ("Host", parts.netloc),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            *(headers or []),
        ]
        target = parts.path + (f"?{parts.query}" if parts.query else "") or "/"
        writer.write(conn.send(h11.Request(method="POST", target=target, headers=head)) or b"")
        writer.write(conn.send(h11.Data(data=body)) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        response = await _next_event(conn, reader)
        while isinstance(response, h11.InformationalResponse):
            response = await _next_event(conn, reader)
        if not isinstance(response, h11.Response):
            raise h11.RemoteProtocolError(f"expected a response, got {response!r}")
        rid = next((v.decode() for k, v in response.headers if k.lower() == b"x-request-id"), "")
        yield Answer(response.status_code, rid, conn, reader)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    """The connection's next event, reading from the socket as h11 needs (b"" at its end)."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            if isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("the server closed the connection before the response ended")
            return event
        conn.receive_data(await reader.read(_READ_BYTES))
