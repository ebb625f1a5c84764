"""The workers' internal HTTP API, both sides of it: what the router sends, what a worker
streams back, its load and health, and how an error crosses.

    POST /generate   GenerateRequest (JSON) -> 200 NDJSON TokenChunk lines, the last with a
                     finish_reason, or an error line; or an ErrorReply with its HTTP status
    GET  /load       Load          GET /health   Health (with the ports of the worker's KV events)
    POST /admin/update_weights   UpdateWeightsRequest -> UpdateWeightsReply, or an ErrorReply
                     (signed with the cluster secret when there is one; tsukimi/httpd.py)

An error crosses as (code, message) from tsukimi/errors.py, in an `ErrorReply` body (or a
last `TokenChunk.error` once streaming started), with the HTTP status `http_status` gives its
class, and is raised again as the same class on the router (`raise_error`). `http_status`
is the one error -> status table: the worker answers with it and the OpenAI API too.

The worker (tsukimi/serving/worker/server.py) and the router's client (router/worker_client.py) both import
these types; neither defines its own.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import msgspec

from tsukimi.config import ROLES, Role
from tsukimi.errors import (
    ClosedError,
    DuplicateRequest,
    ErrorTable,
    InvalidArgument,
    ModelNotFound,
    ObjectNotFound,
    PeerError,
    Rejected,
    RpcTimeout,
    TsukimiError,
    WorkerError,
    WorkerUnavailable,
    error_from_code,
)

__all__ = [
    "ROLES",
    "CostProfile",
    "CppHealth",
    "ErrorReply",
    "FinishReason",
    "GenerateRequest",
    "Health",
    "Load",
    "Role",
    "TokenChunk",
    "UpdateWeightsReply",
    "UpdateWeightsRequest",
    "error_reply",
    "http_status",
    "raise_error",
]

FinishReason = Literal["stop", "length"]

# NOTE: the first class that matches wins: subclasses before their bases (ErrorTable checks).
_STATUS: ErrorTable[int] = ErrorTable(
    [
        (ModelNotFound, 404),
        (ObjectNotFound, 404),  # PayloadNotFound: no such weights to update to
        (DuplicateRequest, 409),
        (Rejected, 429),
        (WorkerUnavailable, 503),
        (ClosedError, 503),
        (ValueError, 400),  # InvalidArgument, ConfigError: the input's fault
        (PeerError, 502),  # WorkerError and every other failure of an upstream peer
        (RpcTimeout, 502),
    ],
    default=500,
)


def http_status(error: TsukimiError) -> int:
    """The HTTP status that answers `error` (500 for anything unexpected). Pure."""
    return _STATUS.lookup(error)


class GenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One generation, as the router asks a worker (the body of POST /generate). The worker's
    role decides how much it generates: a prefill worker makes the first token only. Sampling
    is greedy unless a temperature is given (the router always sends one: the client's, else
    the served model's default, tsukimi/engine/generation_defaults.py).
    `weights_version`: the weights the request must run on ("" = the worker's): the router
    sends the prefill's to the decode worker, so that no request continues on other weights
    than its first token's (a live weight update in between fails it with WorkerUnavailable)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    weights_version: str = ""

    def __post_init__(self) -> None:
        # NOTE: msgspec reports a ValueError raised here as a ValidationError while decoding
        if not self.request_id:
            raise InvalidArgument("request_id must not be empty")
        if not self.prompt_ids:
            raise InvalidArgument("the prompt must hold at least one token")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")


class UpdateWeightsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """POST /admin/update_weights: swap in the weights published as `name` in the P2P store
    (tsukimi/serving/worker/weight_update.py); requests still running after `drain_timeout_s` fail."""

    name: str
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("name must not be empty")
        if not self.drain_timeout_s > 0:
            raise InvalidArgument(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")


class UpdateWeightsReply(msgspec.Struct, frozen=True):
    """The new weights version (what the KV format digest includes) and the update's seconds."""

    weights_version: str
    seconds: float


class ErrorReply(msgspec.Struct, frozen=True):
    """An error on the wire: a `TsukimiError` code and its message."""

    code: str
    message: str


class TokenChunk(msgspec.Struct):
    """One NDJSON line of a /generate stream: tokens (several when they were ready together),
    the finish reason on the last line, the prompt tokens whose KV was reused (of those, from
    the pool), or `error` when the request failed inside the worker after it was accepted;
    `weights_version`: the weights the request runs on."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    pool_tokens: int = 0
    error: ErrorReply | None = None
    weights_version: str = ""


class Load(msgspec.Struct, frozen=True):
    """GET /load. waiting: accepted, no token yet; running: producing tokens.
    prefill_slowdown / decode_slowdown: the recent steps' measured time over what the worker's
    `CostProfile` predicts (tsukimi/engine/step_meter.py; 1.0: as profiled, or not measured)."""

    waiting: int
    running: int
    free_blocks: int = 0
    total_blocks: int = 0
    prefill_slowdown: float = 1.0
    decode_slowdown: float = 1.0


class CostProfile(msgspec.Struct, frozen=True):
    """What a worker measured of itself at start-up (tsukimi/engine/profile.py): a
    `LinearCostModel`'s coefficients in seconds, the fit's worst relative error on its points,
    and how long profiling took."""

    prefill_coef: tuple[float, float, float]
    decode_coef: tuple[float, float, float]
    kv_bytes_per_token: int
    max_relative_error: float = 0.0
    seconds: float = 0.0


class CppHealth(msgspec.Struct, frozen=True):
    """What a CPP prefill group's head (tsukimi/serving/prefill_group/head.py) says of its group in
    /health: the fields of `tsukimi.scheduler.cpp.CppGroup`, for the router's Conductor. The
    group serves greedy requests only, one prompt at a time."""

    stages: int
    chunk_tokens: int
    hop_s_per_token: float = 0.0
    hop_latency_s: float = 0.0


class Health(msgspec.Struct, frozen=True):
    """GET /health. `cpp`: set by the head of a CPP prefill group only. `cost`: the worker's
    start-up profile, for the router's Conductor (None: not profiled)."""

    status: str
    name: str
    role: Role
    model: str = ""
    model_name: str = ""
    block_tokens: int = 0
    weights_version: str = "initial"
    kv_events_port: int = 0  # the KV events' PUB socket (tsukimi/serving/kv_events.py); 0: none
    kv_snapshot_port: int = 0  # its snapshot socket
    cpp: CppHealth | None = None
    cost: CostProfile | None = None


def error_reply(error: TsukimiError) -> tuple[int, bytes]:
    """The HTTP status and JSON body that carry `error` to the other side (pure)."""
    return http_status(error), msgspec.json.encode({"error": ErrorReply(error.code, str(error))})


class _ErrorBody(msgspec.Struct, frozen=True):
    error: ErrorReply


def raise_error(status: int, body: bytes, worker: str) -> TsukimiError:
    """The error a worker's non-200 answer stands for: the class it named, or (a body that
    is not an ErrorReply: a proxy, a crash) one chosen by the status. Pure."""
    with contextlib.suppress(msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        reply = msgspec.json.decode(body, type=_ErrorBody).error
        return from_reply(reply, worker)
    text = body[:200].decode(errors="replace")
    if status == 503:
        return WorkerUnavailable(f"worker {worker} answered HTTP 503: {text}")
    return WorkerError(f"worker {worker} answered HTTP {status}: {text}")


def from_reply(reply: ErrorReply, worker: str) -> TsukimiError:
    """The error `reply` names, as its class; a failure of the worker itself names the worker
    (and one of no more specific kind is a WorkerError: the worker failed)."""
    error = error_from_code(reply.code, reply.message)
    if isinstance(error, (PeerError, RpcTimeout)):
        return type(error)(f"worker {worker}: {reply.message}")
    if http_status(error) >= 500:
        return WorkerError(f"worker {worker}: {reply.message}")
    return error
