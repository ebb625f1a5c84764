"""The Mooncake trace format: loading and validating it, and the token count of each block.

A trace is JSONL, one request per line (the FAST'25 release, e.g. ``conversation_trace.jsonl``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival time in milliseconds (never decreasing along the file) and
``hash_ids`` are chained ids of the prompt's 512-token blocks: block k's id stands for all
tokens up to the end of block k, so two requests sharing id k share the whole prefix. On the
real traces ``len(hash_ids) == ceil(input_length / 512)`` and the last block is partial::

    input_length = 1300, block_size = 512
    |<---- block 0 ---->|<---- block 1 ---->|<- block 2 ->|
    0                  512                1024          1300    -> [512, 512, 276]

This module owns the boundary type `TraceRequest`; it never mutates what it returns.
Unknown extra fields on a line are ignored (later trace releases may add some).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

import msgspec

from tsukimi.errors import InvalidArgument

BLOCK_SIZE_TOKENS = 512
"""Tokens per block in the Mooncake traces."""

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]


class _TraceLine(msgspec.Struct):
    """One line as it is on disk; every field required, ints only (bools and floats rejected)."""

    timestamp: _NonNegative
    input_length: _Positive  # NOTE: a request has a prompt; 0 would wedge a simulated instance
    output_length: _NonNegative
    hash_ids: list[int]


_DECODER = msgspec.json.Decoder(_TraceLine)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds from the start of the trace.
        input_length: prompt length in tokens.
        output_length: number of tokens to generate.
        hash_ids: chained ids of the prompt's blocks, first block first.
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRequest]:
    """Read and validate a Mooncake JSONL trace. Blank lines are skipped.

    Args:
        path: the ``.jsonl`` file.
        limit: keep only the first `limit` requests (None: all of them). Lines after the
            limit are not read, so they are not validated either.

    Returns:
        The requests in file order.

    Raises:
        InvalidArgument: the file cannot be read, `limit` is negative, or a line is not a
            valid request (bad JSON, a missing or wrongly typed field, a negative number, a
            non-integer hash id, a timestamp earlier than the previous line's); the message
            names the file and the 1-based line number.
    """
    if limit is not None and limit < 0:
        raise InvalidArgument(f"trace limit must be >= 0, got {limit}")
    try:
        with open(path, "rb") as f:
            return _parse_lines(f, os.fspath(path), limit)
    except OSError as exc:
        raise InvalidArgument(f"cannot read trace {os.fspath(path)}: {exc}") from exc


def _parse_lines(lines: Iterable[bytes], name: str, limit: int | None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    if limit == 0:
        return requests
    decode = _DECODER.decode
    previous_ms = 0
    for line_number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            line = decode(raw)
        except msgspec.DecodeError as exc:  # ValidationError is a subclass
            raise InvalidArgument(f"{name}:{line_number}: invalid trace request: {exc}") from exc
        if line.timestamp < previous_ms:
            raise InvalidArgument(
                f"{name}:{line_number}: timestamp {line.timestamp} ms is earlier than the previous "
                f"request's {previous_ms} ms"
            )
        previous_ms = line.timestamp
        requests.append(TraceRequest(line.timestamp, line.input_length, line.output_length, tuple(line.hash_ids)))
        if limit is not None and len(requests) >= limit:
            break
    return requests


def block_tokens(request: TraceRequest, block_size: int = BLOCK_SIZE_TOKENS) -> list[int]:
    """Tokens held by each block of `request`: block k holds
    ``min(block_size, input_length - block_size * k)``, clamped at 0 when a trace has more
    ids than tokens. Pure.

    Args:
        request: the request.
        block_size: tokens per full block.

    Returns:
        One count per hash id, in order.

    Raises:
        InvalidArgument: `block_size` is not positive.
    """
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    length = request.input_length
    return [max(0, min(block_size, length - block_size * k)) for k in range(len(request.hash_ids))]
