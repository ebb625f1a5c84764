"""The router's prefix index follows a real prefill worker process through its KV events: a
KV cache of 24 blocks forces evictions; after every request the router expected exactly the
reuse the worker reported (one request at a time: nothing changes the worker's cache between
placement and prefill), and at the end the index holds exactly the worker's block set."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Iterator

import httpx
import pytest

from tsukimi.config import ROUTER_CONDUCTOR, RouterConfig
from tsukimi.serving.kv_events import request_snapshot
from tsukimi.serving.protocol import GenerateRequest, Health
from tsukimi.serving.router.router import Router, TokenEvent
from tsukimi.serving.router.workers import WorkerSpec
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.workers import launched_workers, pd_configs

NUM_BLOCKS = 24
FAST = RouterConfig(poll_interval_s=0.05, connect_timeout_s=2.0, read_timeout_s=30.0, startup_timeout_s=30.0)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with TsukimiCluster(64 << 20, num_holders=0) as store:
        configs = pd_configs(store.master_addr, 32 << 20, prefill_blocks=NUM_BLOCKS)
        with launched_workers(configs, tmp_path_factory.mktemp("workers")) as urls:
            yield urls


def _worker_blocks(url: str) -> tuple[int, set[int]]:
    """The prefill worker's (next seq, block set), from its snapshot socket."""
    health = httpx.get(url + "/health", timeout=5).json()
    port = Health(**health).kv_snapshot_port
    snapshot = request_snapshot(f"tcp://127.0.0.1:{port}")
    return snapshot.next_seq, set(snapshot.media["CPU"])


@pytest.mark.timeout(180)
def test_index_follows_a_small_cache_with_evictions(workers: dict[str, str]) -> None:
    rng = random.Random(0)
    stems = [[rng.randrange(3, 250) for _ in range(48)] for _ in range(8)]  # 3 blocks each
    prompts = [
        stems[rng.randrange(8)] + [rng.randrange(3, 250) for _ in range(rng.choice((5, 20, 40)))] for _ in range(20)
    ]
    specs = [WorkerSpec("prefill", "prefill", workers["prefill"]), WorkerSpec("decode", "decode", workers["decode"])]
    router = Router(specs, FAST, dataclasses.replace(ROUTER_CONDUCTOR, rejection="none"))

    async def main() -> list[TokenEvent]:
        firsts = []
        try:
            for n, prompt in enumerate(prompts):
                request = GenerateRequest(f"r{n}", tuple(prompt), 2, ignore_eos=True)
                stream = [event async for event in router.generate(request)]  # NOTE: to its end
                firsts.append(stream[0])
                await asyncio.sleep(0.05)  # NOTE: the events of this prefill reach the router
            feed = router._feed
            assert feed is not None
            events = feed.instances["prefill"]
            async with asyncio.timeout(10):
                while True:  # caught up with the worker (heartbeats keep the seqs moving)
                    seq, blocks = await asyncio.to_thread(_worker_blocks, workers["prefill"])
                    if events.next_seq == seq:
                        break
                    await asyncio.sleep(0.05)
            held = {b for b in blocks if router.index.match_at("prefill/dram", [b])}
            assert held == blocks and router.index.num_blocks("prefill/dram") == len(blocks) <= NUM_BLOCKS
            assert events.stats.resyncs == 0
        finally:
            await router.close()
        return firsts

    firsts = asyncio.run(main())
    records = router.decisions.get([f"r{n}" for n in range(len(prompts))])
    assert len(records) == len(firsts)
    for event, record in zip(firsts, records, strict=True):
        assert record.expected_cached_tokens == event.cached_tokens and not record.expected_concurrent
    stored_blocks = sum(len(p) // 16 for p in prompts)
    assert stored_blocks > 2 * NUM_BLOCKS  # NOTE: the cache turned over: evictions happened
    assert any(e.cached_tokens for e in firsts) and any(e.pool_tokens for e in firsts)
