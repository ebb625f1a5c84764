"""hash_blocks: chaining, determinism across processes, salts, partial blocks, validation."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from hashlib import blake2b

import numpy as np
import pytest

from tsukimi.errors import ConfigError, InvalidArgument
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks


def reference(tokens: list[int], block_size: int, salt: bytes = b"", include_partial: bool = False) -> list[int]:
    """The definition, spelled out with struct: H(parent as 8 LE bytes || tokens as LE uint32), keyed by salt."""
    out: list[int] = []
    parent = 0
    stop = len(tokens) if include_partial else len(tokens) - len(tokens) % block_size
    for start in range(0, stop, block_size):
        block = tokens[start : start + block_size]
        data = parent.to_bytes(8, "little") + struct.pack(f"<{len(block)}I", *block)
        parent = int.from_bytes(blake2b(data, digest_size=8, key=salt).digest(), "little")
        out.append(parent)
    return out


TOKENS = [(i * 7919 + 13) % 128_256 for i in range(2048)]
SCRIPT = (
    "from tsukimi.scheduler.block_hash import hash_blocks;"
    "print(hash_blocks([(i * 7919 + 13) % 128_256 for i in range(2048)], 512, b'tenant-a'))"
)


def test_hashes_follow_the_documented_definition() -> None:
    assert hash_blocks(TOKENS, 512) == reference(TOKENS, 512)
    assert hash_blocks(TOKENS, 16, salt=b"k") == reference(TOKENS, 16, b"k")
    assert hash_blocks(TOKENS[:1000], 512, include_partial=True) == reference(TOKENS[:1000], 512, include_partial=True)


def test_golden_value_pins_the_hash_across_versions() -> None:
    # NOTE: these ids may be persisted or published by other processes: changing the
    # definition is a wire change, so it must fail this test, not slip through.
    assert hash_blocks([1, 2, 3, 4], block_size=2) == reference([1, 2, 3, 4], 2)
    assert hash_blocks([1, 2, 3, 4], block_size=2) == [18389742664249816232, 11220972698411055348]


def test_shared_prefix_gives_equal_hashes_then_they_diverge() -> None:
    a = TOKENS[:1024] + [1] * 1024
    b = TOKENS[:1024] + [1] * 511 + [2] + [1] * 512
    ha, hb = hash_blocks(a, 512), hash_blocks(b, 512)
    assert len(ha) == len(hb) == 4
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]
    assert ha[3] != hb[3]  # block 3 has the same tokens in both, but a different prefix


def test_changing_the_first_token_changes_every_hash() -> None:
    other = [TOKENS[0] + 1, *TOKENS[1:]]
    assert all(x != y for x, y in zip(hash_blocks(TOKENS, 512), hash_blocks(other, 512), strict=True))


def test_parent_continues_a_chain() -> None:
    full = hash_blocks(TOKENS, 512)
    assert hash_blocks(TOKENS[1024:], 512, parent=full[1]) == full[2:]
    assert hash_blocks(TOKENS, 512, parent=None) == hash_blocks(TOKENS, 512, parent=BlockHash(0))


def test_same_hashes_in_other_processes_whatever_their_hash_seed() -> None:
    expected = str(hash_blocks(TOKENS, 512, b"tenant-a"))
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        assert done.stdout.strip() == expected


def test_salt_changes_every_hash() -> None:
    plain = hash_blocks(TOKENS, 512)
    for salt in (b"a", b"a\x00", b"tenant-b", b"x" * 16):
        salted = hash_blocks(TOKENS, 512, salt=salt)
        assert all(x != y for x, y in zip(plain, salted, strict=True)), salt
    # key length is part of the hash: a salt padded with a zero byte is a different tenant
    assert all(x != y for x, y in zip(hash_blocks(TOKENS, 512, b"a"), hash_blocks(TOKENS, 512, b"a\x00"), strict=True))


def test_partial_block_is_hashed_only_when_asked() -> None:
    tokens = TOKENS[:1000]
    full_only = hash_blocks(tokens, 512)
    with_partial = hash_blocks(tokens, 512, include_partial=True)
    assert len(full_only) == 1
    assert len(with_partial) == 2
    assert with_partial[0] == full_only[0]
    assert with_partial[1] == hash_blocks(tokens[512:], 512, parent=full_only[0], include_partial=True)[0]
    assert with_partial[1] != hash_blocks(TOKENS[:1024], 512)[1]  # a partial block is not its completion


def test_exact_multiple_and_short_inputs() -> None:
    assert len(hash_blocks(TOKENS[:1024], 512, include_partial=True)) == 2
    assert hash_blocks([], 512) == []
    assert hash_blocks([], 512, include_partial=True) == []
    assert hash_blocks(TOKENS[:511], 512) == []
    assert len(hash_blocks(TOKENS[:511], 512, include_partial=True)) == 1


def test_every_input_type_gives_the_same_hashes() -> None:
    expected = hash_blocks(TOKENS, 64)
    assert hash_blocks(tuple(TOKENS), 64) == expected
    assert hash_blocks(np.array(TOKENS, dtype=np.int64), 64) == expected
    assert hash_blocks(np.array(TOKENS, dtype=np.uint32), 64) == expected
    assert hash_blocks(np.array(TOKENS, dtype=np.int32)[::1], 64) == expected
    assert hash_blocks(np.repeat(np.array(TOKENS, dtype=np.int64), 2)[::2], 64) == expected  # not contiguous
    small = list(range(256)) * 2
    assert hash_blocks(bytes(small), 8) == hash_blocks(small, 8)


def test_token_bounds() -> None:
    assert len(hash_blocks([0, 2**32 - 1], 2)) == 1
    for bad in ([-1, 0], [0, 2**32], [0, 1.5]):
        with pytest.raises(InvalidArgument):
            hash_blocks(bad, 2)  # type: ignore[arg-type]
    for array in (np.array([-1, 0]), np.array([0, 2**32], dtype=np.uint64), np.array([0.0, 1.0]), np.zeros((2, 2))):
        with pytest.raises(InvalidArgument):
            hash_blocks(array, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [0, -512, 1.5])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(InvalidArgument):
        hash_blocks(TOKENS, block_size)


def test_salt_must_be_short_bytes() -> None:
    with pytest.raises(ConfigError):
        hash_blocks(TOKENS, 512, salt=b"x" * 17)
    with pytest.raises(ConfigError):
        hash_blocks(TOKENS, 512, salt="tenant")  # type: ignore[arg-type]


def test_parent_must_be_unsigned_64_bit() -> None:
    for parent in (-1, 2**64):
        with pytest.raises(InvalidArgument):
            hash_blocks(TOKENS, 512, parent=BlockHash(parent))
