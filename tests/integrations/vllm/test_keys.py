"""The connector's pure parts, without vLLM: keys and the format digest, block arithmetic,
the extra-config parser and the pool link's behaviour while the master is down."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from tsukimi.errors import ConfigError
from tsukimi.integrations.vllm.config import PoolLink, TsukimiConnectorConfig
from tsukimi.integrations.vllm.keys import (
    KVFormat,
    SaveRange,
    block_key,
    block_keys,
    blocks_to_save,
    leading_hits,
    max_loadable_blocks,
)
from tsukimi.netio import free_port

FORMAT = KVFormat("m@", "float32", 128, (2, 128, 64), 4, "cpu:x86_64:vec")


def test_digest_is_stable_and_names_every_field() -> None:
    assert FORMAT.digest() == KVFormat("m@", "float32", 128, (2, 128, 64), 4, "cpu:x86_64:vec").digest()
    assert len(FORMAT.digest()) == 16 and int(FORMAT.digest(), 16) >= 0
    changes = {
        "model": "other@",
        "dtype": "bfloat16",
        "block_size": 16,
        "block_shape": (2, 128, 128),
        "num_layers": 30,
        "kernel": "cpu:x86_64:amx",
        "hash_algo": "xxhash",
    }
    digests = {dataclasses.replace(FORMAT, **{name: value}).digest() for name, value in changes.items()}
    assert len(digests) == len(changes) and FORMAT.digest() not in digests


def test_block_keys_are_per_layer() -> None:
    assert block_key("d" * 16, b"\x01\xff", 3) == "vllm/dddddddddddddddd/01ff/3"
    assert block_keys("d", b"\x00", 2) == ["vllm/d/00/0", "vllm/d/00/1"]


@pytest.mark.parametrize(
    ("num_tokens", "expected"), [(0, 0), (1, 0), (128, 0), (129, 1), (640, 4), (641, 5), (645, 5), (1000, 7)]
)
def test_never_the_whole_prompt(num_tokens: int, expected: int) -> None:
    assert max_loadable_blocks(num_tokens, 128) == expected


def test_leading_hits_needs_every_layer_and_stops_at_the_first_gap() -> None:
    assert leading_hits([True, True, True, False, True, True], 2) == 1
    assert leading_hits([True] * 6, 2) == 3
    assert leading_hits([False, True, True, True], 2) == 0
    assert leading_hits([], 4) == 0
    with pytest.raises(ValueError, match="layers"):
        leading_hits([True] * 3, 2)


def test_blocks_to_save_covers_full_prompt_blocks_once() -> None:
    assert blocks_to_save(0, 300, 645, 128) == SaveRange(0, 2)  # a chunk of the prefill
    assert blocks_to_save(2, 645, 645, 128) == SaveRange(2, 5)  # the rest: the partial block stays
    assert blocks_to_save(5, 700, 645, 128) == SaveRange(5, 5)  # decode tokens are not saved
    assert blocks_to_save(0, 100, 100, 128) == SaveRange(0, 0)


def test_extra_config_is_checked() -> None:
    config = TsukimiConnectorConfig.from_extra({"master": "tcp://10.0.0.1:5", "rpc_timeout_s": 2, "pd_port": 7})
    assert (config.master, config.rpc_timeout_s, config.pd_port) == ("tcp://10.0.0.1:5", 2.0, 7)
    with pytest.raises(ConfigError, match="unknown"):
        TsukimiConnectorConfig.from_extra({"mastr": "x"})
    with pytest.raises(ConfigError, match="must be bool"):
        TsukimiConnectorConfig.from_extra({"load_async": "yes"})
    with pytest.raises(ConfigError, match="pd_mode"):
        TsukimiConnectorConfig.from_extra({"pd_mode": "push"})
    assert config.tsukimi_config().client.rpc_timeout_s == 2.0


def test_master_down_means_no_pool_for_retry_s_and_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    config = TsukimiConnectorConfig(master=f"tcp://127.0.0.1:{free_port()}", rpc_timeout_s=0.2, retry_s=30.0)
    link = PoolLink(config)
    with caplog.at_level(logging.WARNING, logger="tsukimi.integrations.vllm.config"):
        started = time.monotonic()
        assert link.client() is None
        assert time.monotonic() - started < 3.0
        started = time.monotonic()
        for _ in range(100):  # within retry_s: answered at once, no new attempt
            assert link.client() is None
        assert time.monotonic() - started < 0.1
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
    link.close()
