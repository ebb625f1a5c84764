"""Hypothesis strategies shared by the fuzz targets: structure-aware damage to valid inputs.

`mutated(valid)` takes well-formed encodings and breaks them the ways a network does or an
attacker would: flipped bytes, truncation, inserted and duplicated runs. `values()` is any
msgpack/JSON value (wrong types for any field); `EDGE_INTS` and `edge_strings()` are the
out-of-range values to put in fields of the right type.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from hypothesis import strategies as st

EDGE_INTS = (
    -(2**63),
    -(2**31),
    -1,
    0,
    1,
    2,
    63,
    64,
    4095,
    4096,
    4097,
    2**31 - 1,
    2**31,
    2**32,
    2**40,
    2**40 + 1,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
)
HUGE_INTS = (2**64, 2**100, -(2**64), -(2**100))  # beyond 64 bits: JSON only
NOT_UTF8 = (b"\xff", b"\xfe\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"a\x80b", b"\xf4\x90\x80\x80")


def edge_ints() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**64 - 1))


def edge_strings() -> st.SearchStrategy[str]:
    """Empty, huge (100 KB), NUL, multi-byte, separators, and ordinary text."""
    return st.one_of(
        st.sampled_from(["", "k", "\x00", "a/b", "../..", "é" * 3000, "x" * 100_000, "k" * 4096, "\u2028"]),
        st.text(max_size=24),
    )


def _leaves() -> st.SearchStrategy[object]:
    return st.one_of(
        st.none(),
        st.booleans(),
        edge_ints(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=16),
        st.binary(max_size=16),
    )


def values(max_leaves: int = 12) -> st.SearchStrategy[object]:
    """Any msgpack-encodable value: scalars, lists and maps, a few levels deep."""
    return st.recursive(
        _leaves(),
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=max_leaves,
    )


def not_utf8_msgpack_str() -> st.SearchStrategy[msgspec.Raw]:
    """A msgpack str whose bytes are not UTF-8 (msgspec.Raw embeds it as is)."""
    return st.sampled_from(NOT_UTF8).map(lambda raw: msgspec.Raw(bytes([0xA0 | len(raw)]) + raw))


@st.composite
def mutated(draw: st.DrawFn, valid: Sequence[bytes]) -> bytes:
    """One of `valid`, damaged by 1-4 edits (flip, truncate, insert, duplicate, delete)."""
    data = bytearray(draw(st.sampled_from(valid)))
    for _ in range(draw(st.integers(1, 4))):
        edit = draw(st.sampled_from(("flip", "set", "truncate", "insert", "duplicate", "delete")))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if edit == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "set" and data:
            data[at] = draw(st.sampled_from((0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xD9, 0xDB, 0xDC, 0xDD, 0xDF, 0xFF)))
        elif edit == "truncate":
            del data[at:]
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif edit == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
        elif edit == "delete":
            del data[at : at + draw(st.integers(1, 4))]
    return bytes(data)


def deep_msgpack(depth: int) -> bytes:
    """A msgpack value nested `depth` arrays deep (fixarray of one element each)."""
    return b"\x91" * depth + b"\xc0"
