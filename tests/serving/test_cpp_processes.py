"""Chunked pipeline parallelism across real processes: a prefill group of two stage processes
(each half of the layers) computes a long prompt chunk by chunk, both publish their layers' KV
to the pool, and a decode worker process loads all of it and generates; the first token and
every later one equal one worker's greedy output exactly."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.serving.test_pd_processes import _generate
from tsukimi.config import WorkerConfig
from tsukimi.config.pipeline import PrefillStageConfig
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import random_tiny
from tsukimi.netio import free_port
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.prefill_group.commands import stage_args
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.workers import worker_spec

CHUNK = 128
PROMPTS = [[1, *((37 * i) % 31000 + 3 for i in range(700))], [1, *range(900, 1000)], [1, 2, 3]]
NEW = 6


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A CPP group of two stages (the head a prefill worker to its callers) and a decode worker,
    all on one store; the prefill and decode URLs."""
    with TsukimiCluster(16 << 20, num_holders=0) as store:
        head, tail, decode = free_port(), free_port(), free_port()
        common = {"num_stages": 2, "model": "tiny", "master": store.master_addr, "chunk_tokens": CHUNK}
        later = PrefillStageConfig(name="cpp-1", stage=1, port=tail, segment_bytes=32 << 20, **common)  # type: ignore[arg-type]
        first = PrefillStageConfig(
            name="cpp",
            stage=0,
            port=head,
            downstream=f"127.0.0.1:{tail}",
            segment_bytes=32 << 20,
            **common,  # type: ignore[arg-type]
        )
        decoder = WorkerConfig(
            name="decode",
            role="decode",
            model="tiny",
            port=decode,
            master=store.master_addr,
            segment_bytes=16 << 20,
            num_blocks=256,
        )
        specs = [
            ProcessSpec("cpp-1", "cpp-stage", stage_args(later), f"127.0.0.1:{tail}", health="none"),
            ProcessSpec("cpp", "prefill", stage_args(first), f"http://127.0.0.1:{head}"),
            worker_spec(decoder),
        ]
        with LaunchedCluster([specs], LaunchConfig(tmp_path_factory.mktemp("group"), startup_timeout_s=120)):
            yield {"prefill": f"http://127.0.0.1:{head}", "decode": f"http://127.0.0.1:{decode}"}


def _tokens(lines: list[dict[str, object]]) -> list[int]:
    return [t for line in lines for t in line["token_ids"]]  # type: ignore[attr-defined]


@pytest.mark.timeout(180)
def test_cpp_group_then_pooled_decode_equals_one_worker(group: dict[str, str]) -> None:
    torch.set_num_threads(1)
    loaded = random_tiny(0)
    mc = loaded.config
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, mc.torch_dtype)
    one_worker = LLMEngine(loaded.model, layout, 256, mc.eos_token_ids, CHUNK)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    for n, prompt in enumerate(PROMPTS):
        expected = one_worker.generate([prompt], params)[0]
        first = _generate(group["prefill"], f"p{n}", prompt, NEW)
        assert _tokens(first) == expected[:1]
        rest = _generate(group["decode"], f"d{n}", prompt + expected[:1], NEW - 1)
        assert _tokens(rest) == expected[1:]
        # every full block of the prompt came from the pool: both stages published their layers
        assert rest[0]["pool_tokens"] == len(prompt) // 16 * 16


def test_cpp_group_refuses_sampling(group: dict[str, str]) -> None:
    body = {"request_id": "t", "prompt_ids": [1, 2, 3], "max_tokens": 2, "temperature": 0.7}
    assert httpx.post(group["prefill"] + "/generate", json=body, timeout=10).status_code == 400
