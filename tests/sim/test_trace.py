"""Tests of `tsukimi.sim.trace`: the shipped sample, every validation error with its line number,
and the token count of each block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tsukimi.errors import InvalidArgument
from tsukimi.sim.trace import TraceRequest, block_tokens, load_trace

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "traces" / "conversation_sample.jsonl"
GOOD = '{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}'


def write_trace(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_loads_the_shipped_sample() -> None:
    requests = load_trace(SAMPLE)
    assert len(requests) == 1000
    first = json.loads(SAMPLE.read_text().splitlines()[0])
    assert requests[0] == TraceRequest(
        timestamp_ms=first["timestamp"],
        input_length=first["input_length"],
        output_length=first["output_length"],
        hash_ids=tuple(first["hash_ids"]),
    )
    assert requests[0] == TraceRequest(0, 6758, 500, tuple(range(14)))
    assert all(type(r.hash_ids) is tuple for r in requests)
    # On the real trace every id stands for 512 tokens but the last, which may be partial.
    assert all(sum(block_tokens(r)) == r.input_length for r in requests)


def test_limit_and_blank_lines(tmp_path: Path) -> None:
    later = GOOD.replace('"timestamp": 5', '"timestamp": 9')
    path = write_trace(tmp_path, GOOD, "", "   ", later, "not json: never read")
    assert [r.timestamp_ms for r in load_trace(path, limit=2)] == [5, 9]
    assert load_trace(path, limit=0) == []
    assert load_trace(SAMPLE, limit=3) == load_trace(SAMPLE)[:3]
    with pytest.raises(InvalidArgument, match="limit"):
        load_trace(path, limit=-1)


def test_equal_timestamps_and_extra_fields_are_accepted(tmp_path: Path) -> None:
    extra = GOOD.replace("}", ', "session": "x"}')
    requests = load_trace(write_trace(tmp_path, GOOD, extra))
    assert requests == [TraceRequest(5, 600, 7, (1, 2))] * 2


BAD_LINES = {
    "bad JSON": '{"timestamp": 6, "input_length": 1',
    "not an object": "[1, 2, 3]",
    "missing field": '{"timestamp": 6, "input_length": 600, "hash_ids": [1]}',
    "string field": '{"timestamp": 6, "input_length": "600", "output_length": 7, "hash_ids": [1]}',
    "float field": '{"timestamp": 6.5, "input_length": 600, "output_length": 7, "hash_ids": [1]}',
    "bool field": '{"timestamp": 6, "input_length": 600, "output_length": true, "hash_ids": [1]}',
    "null field": '{"timestamp": 6, "input_length": null, "output_length": 7, "hash_ids": [1]}',
    "negative timestamp": '{"timestamp": -1, "input_length": 600, "output_length": 7, "hash_ids": [1]}',
    "negative input": '{"timestamp": 6, "input_length": -600, "output_length": 7, "hash_ids": [1]}',
    "negative output": '{"timestamp": 6, "input_length": 600, "output_length": -7, "hash_ids": [1]}',
    "empty prompt": '{"timestamp": 6, "input_length": 0, "output_length": 7, "hash_ids": []}',
    "float hash id": '{"timestamp": 6, "input_length": 600, "output_length": 7, "hash_ids": [1, 2.0]}',
    "string hash id": '{"timestamp": 6, "input_length": 600, "output_length": 7, "hash_ids": ["1"]}',
    "hash ids not a list": '{"timestamp": 6, "input_length": 600, "output_length": 7, "hash_ids": 1}',
    "timestamp going backwards": '{"timestamp": 4, "input_length": 600, "output_length": 7, "hash_ids": [1]}',
}


@pytest.mark.parametrize("bad", BAD_LINES.values(), ids=list(BAD_LINES))
def test_invalid_line_names_file_and_line(tmp_path: Path, bad: str) -> None:
    path = write_trace(tmp_path, GOOD, "", bad, GOOD)  # the bad line is line 3
    with pytest.raises(InvalidArgument) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:3: ")


def test_messages_say_what_is_wrong(tmp_path: Path) -> None:
    cases = {
        "missing field": "output_length",
        "string field": "$.input_length",
        "negative output": ">= 0",
        "empty prompt": ">= 1",
        "float hash id": "$.hash_ids[1]",
        "timestamp going backwards": "timestamp 4 ms is earlier than the previous request's 5 ms",
    }
    for name, expected in cases.items():
        with pytest.raises(InvalidArgument, match=expected.replace("[", r"\[").replace("$", r"\$")):
            load_trace(write_trace(tmp_path, GOOD, BAD_LINES[name]))


def test_unreadable_file_is_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("input_length", "num_ids", "block_size", "expected"),
    [
        (1300, 3, 512, [512, 512, 276]),
        (1024, 2, 512, [512, 512]),
        (1, 1, 512, [1]),
        (600, 4, 512, [512, 88, 0, 0]),  # more ids than tokens: clamped at 0
        (0, 2, 512, [0, 0]),
        (2000, 2, 512, [512, 512]),  # fewer ids than tokens: only the ids count
        (250, 3, 100, [100, 100, 50]),
        (700, 0, 512, []),
    ],
)
def test_block_tokens(input_length: int, num_ids: int, block_size: int, expected: list[int]) -> None:
    request = TraceRequest(0, input_length, 1, tuple(range(num_ids)))
    assert block_tokens(request, block_size) == expected


def test_block_tokens_rejects_non_positive_block_size() -> None:
    with pytest.raises(InvalidArgument, match="block_size"):
        block_tokens(TraceRequest(0, 10, 1, (1,)), block_size=0)
