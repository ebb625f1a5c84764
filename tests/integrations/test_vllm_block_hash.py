"""The router's block hashes equal vLLM's own (hash_block_tokens with NONE_HASH), computed in
.venv-vllm by vLLM itself; and the event keys are vLLM's int conversion."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integrations.vllm_env import vllm_python
from tsukimi.errors import ConfigError
from tsukimi.integrations.vllm.block_hash import VllmBlockHasher, VllmHashConfig, event_key

_VLLM_SIDE = """
import json, sys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
out = {}
for algo in ("sha256", "sha256_cbor"):
    fn = get_hash_fn_by_name(algo)
    k.init_none_hash(fn)
    tokens, parent, hashes = list(range(7, 7 + 40)), None, []
    for start in range(0, 40 - 16 + 1, 16):
        parent = k.hash_block_tokens(fn, parent, tokens[start:start + 16], None)
        hashes.append(k.maybe_convert_block_hash(parent))
    out[algo] = [h if isinstance(h, int) else h.hex() for h in hashes]
print(json.dumps(out))
"""


def test_partial_blocks_have_no_hash_and_chains_differ() -> None:
    hasher = VllmBlockHasher(VllmHashConfig(block_size=4, seed="x"))
    assert hasher.hashes([1, 2, 3]) == []
    a, b = hasher.keys([1, 2, 3, 4, 5, 6, 7, 8]), hasher.keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # the second block differs through its parent
    assert event_key(b"\x00" * 24 + (258).to_bytes(8, "big")) == 258 == event_key(258)


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="sha256"):
        VllmHashConfig(algo="xxhash")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        VllmHashConfig(block_size=0)


def test_equal_to_vllms_own_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    python = vllm_python()
    if python is None:
        pytest.skip(".venv-vllm is missing (make vllm)")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    env = {"PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([str(python), "-c", _VLLM_SIDE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for algo in ("sha256", "sha256_cbor"):
        try:
            ours = VllmBlockHasher(VllmHashConfig(block_size=16, algo=algo)).keys(list(range(7, 47)))  # type: ignore[arg-type]
        except ModuleNotFoundError:  # cbor2 is not in tsukimi's venv
            continue
        assert ours == theirs[algo], algo
    assert VllmBlockHasher(VllmHashConfig(block_size=16)).keys(list(range(7, 47))) == theirs["sha256"]
