"""CPP prefill groups in `tsukimi up`: the plan starts a k-stage group beside the ordinary
workers, and a real cluster of the tiny model (one prefill worker, one 2-stage group, one
decode worker) places a long greedy prompt on the group and a short one on the prefill
worker, both completing exactly as one worker would; a long sampled prompt never reaches the
group (it is greedy-only)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.serving.test_cluster import running
from tsukimi.config import ClusterConfig, load
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.tokenizer import load_tokenizer
from tsukimi.engine.weights import random_tiny
from tsukimi.errors import ConfigError
from tsukimi.netio import free_port
from tsukimi.serving.cluster.up import plan

CHUNK = 128
LONG = [1, *((37 * i) % 31000 + 3 for i in range(2100))]
SHORT = [1, *range(900, 940)]
NEW = 4


def test_plan_starts_the_groups_stages_beside_the_workers() -> None:
    overrides = [
        "model=tiny",
        "workers.cpp_groups=1",
        "workers.cpp_stages=2",
        "workers.cpp_chunk_tokens=64",
        "workers.num_blocks=32",
        "workers.base_port=9100",
    ]
    config = load(ClusterConfig, None, overrides)
    ports = itertools.count(7001)
    _, workers, router = plan(config, lambda: next(ports))
    assert [(s.name, s.role, s.url, s.health) for s in workers] == [
        ("prefill-0", "prefill", "http://127.0.0.1:9100", "tsukimi"),
        ("decode-0", "decode", "http://127.0.0.1:9101", "tsukimi"),
        ("cpp-0", "prefill", "http://127.0.0.1:9102", "tsukimi"),
        ("cpp-0-s1", "cpp-stage", "127.0.0.1:9103", "none"),
    ]
    head, tail = (dict(zip(s.args[1::2], s.args[2::2], strict=True)) for s in workers[2:])
    assert [head[f] for f in ("--stage", "--num-stages", "--downstream")] == ["0", "2", "127.0.0.1:9103"]
    assert (tail["--stage"], tail["--port"], tail["--downstream"]) == ("1", "9103", "")
    assert head["--master"] == tail["--master"] == "tcp://127.0.0.1:7001"
    assert (head["--chunk-tokens"], head["--num-blocks"], head["--model"]) == ("64", "32", "tiny")
    listed = router[0].args[router[0].args.index("--workers") + 1]
    assert listed.split(",")[2:] == ["cpp-0=prefill@http://127.0.0.1:9102"]  # the head only


def test_groups_need_mode_pd_and_count_as_prefill_workers() -> None:
    with pytest.raises(ConfigError, match="need mode pd"):
        load(ClusterConfig, None, ["mode=colocated", "workers.cpp_groups=1"])
    with pytest.raises(ConfigError, match="cpp_chunk_tokens must be"):
        load(ClusterConfig, None, ["workers.cpp_stages=0"])
    groups_only = load(ClusterConfig, None, ["workers.prefill=0", "workers.cpp_groups=1"])
    assert [s.name for s in plan(groups_only, lambda: 1)[1]] == ["decode-0", "cpp-0", "cpp-0-s1"]


def cluster_text(tmp_path: Path) -> str:
    return (
        f'model = "tiny"\nlog_dir = "{tmp_path / "logs"}"\nstartup_timeout_s = 90\nstop_timeout_s = 5\n'
        f"[workers]\nnum_blocks = 256\nsegment_bytes = {16 << 20}\ncpp_groups = 1\ncpp_stages = 2\n"
        f"cpp_chunk_tokens = {CHUNK}\n[router]\nport = {free_port()}\n"
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API URL of a running cluster with a CPP group."""
    tmp_path = tmp_path_factory.mktemp("cpp-up")
    with running(tmp_path, cluster_text(tmp_path), 90) as state:
        yield str(state["api"])


def placed(api: str) -> dict[str, int]:
    """How many requests the router has sent each worker."""
    return {w["name"]: w["requests"] for w in httpx.get(api + "/health", timeout=5).json()["workers"]}


def complete(api: str, prompt: list[int], temperature: float = 0.0) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "ignore_eos": True, "temperature": temperature}
    response = httpx.post(api + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


@pytest.mark.timeout(240)
def test_long_greedy_prompts_go_to_the_group_and_match_one_worker(cluster: str) -> None:
    torch.set_num_threads(1)
    loaded = random_tiny(0)
    mc = loaded.config
    one_worker = LLMEngine(
        loaded.model,
        KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, mc.torch_dtype),
        256,
        mc.eos_token_ids,
        CHUNK,
    )
    tokenizer, params = load_tokenizer("tiny"), SamplingParams(max_tokens=NEW, ignore_eos=True)
    before = placed(cluster)
    assert complete(cluster, LONG) == tokenizer.decode(one_worker.generate([LONG], params)[0])
    after_long = placed(cluster)
    assert complete(cluster, SHORT) == tokenizer.decode(one_worker.generate([SHORT], params)[0])
    after_short = placed(cluster)
    prefills = ("cpp-0", "prefill-0")
    assert [after_long[n] - before[n] for n in prefills] == [1, 0]  # the long prompt: the group
    assert [after_short[n] - after_long[n] for n in prefills] == [0, 1]  # the short one: the worker


@pytest.mark.timeout(240)
def test_a_long_sampled_prompt_is_not_sent_to_the_group(cluster: str) -> None:
    before = placed(cluster)
    complete(cluster, LONG, temperature=0.7)
    after = placed(cluster)
    assert (after["cpp-0"] - before["cpp-0"], after["prefill-0"] - before["prefill-0"]) == (0, 1)
