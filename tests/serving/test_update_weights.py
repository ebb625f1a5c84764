"""Live weight updates (tsukimi/serving/worker/weight_update.py): the weights version in the KV format
and the block hashes, the engine's prefix cache dropped, the engine thread's pause, and a
colocated worker in this process updated through a P2P store on an in-process metadata service
(unknown payload 404, another model's manifest 400 with the old weights kept, bad bodies 400,
the cluster secret). The same through `tsukimi up` with real processes: test_update_weights_up.py."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future

import httpx
import pytest

from tsukimi import httpd
from tsukimi.config import Config, MetadataConfig, WorkerConfig
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import BlockPool, KVLayout
from tsukimi.engine.kv_pool import KVFormat
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel, random_tiny
from tsukimi.errors import ClosedError, InvalidArgument, WorkerUnavailable
from tsukimi.p2p import P2PStore
from tsukimi.p2p.weights import publish_state_dict
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.serving.worker.engine_thread import (
    AddCommand,
    EngineThread,
    PauseCommand,
    RequestStream,
    Verdict,
    WorkerMetrics,
)
from tsukimi.serving.worker.server import Worker

BLOCK_TOKENS = 16
PROMPT = list(range(1000, 1040))  # two full blocks and a partial one
SECRET = "update-weights-test-secret-0123456789"


def layout_of(loaded: LoadedModel) -> KVLayout:
    c = loaded.config
    return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK_TOKENS, c.torch_dtype)


def reference(seed: int, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a fresh engine on the tiny model of `seed`."""
    loaded = random_tiny(seed)
    engine = LLMEngine(loaded.model, layout_of(loaded), 64, loaded.config.eos_token_ids)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


def test_the_kv_format_digest_includes_the_weights_version() -> None:
    layout = KVLayout(2, 2, 8, BLOCK_TOKENS)
    initial, again = KVFormat.of("model", layout), KVFormat.of("model", layout, "initial")
    updated = KVFormat.of("model", layout, "step-2@0123")
    assert initial.digest == again.digest and initial.weights_version == "initial"
    assert updated.digest != initial.digest and updated.prefix != initial.prefix
    assert updated.key(BlockHash(7), 0) != initial.key(BlockHash(7), 0)
    assert KVFormat.of("model", layout, "step-2@0123").digest == updated.digest  # equal weights share KV


def test_drop_cached_frees_idle_blocks_and_forgets_the_referenced_ones() -> None:
    pool = BlockPool(4)
    held, idle = pool.allocate(), pool.allocate()
    assert held is not None and idle is not None
    pool.cache(held, BlockHash(1))
    pool.cache(idle, BlockHash(2))
    pool.release([idle])
    assert pool.drop_cached() == 2
    pool.check_invariants()
    assert pool.lookup([BlockHash(1)]) == [] and pool.lookup([BlockHash(2)]) == []
    assert pool.num_free == 3  # the idle one is free again; `held` stays with its holder
    pool.release([held])
    pool.check_invariants()
    assert pool.num_free == 4


def generate_one(engine: LLMEngine, request_id: str, max_tokens: int = 6) -> tuple[list[int], int]:
    """One request's tokens and its cached prompt tokens."""
    engine.add_request(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens, cached = [], -1
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            cached = out.cached_tokens
    return tokens, cached


def test_new_weights_drop_the_prefix_cache_and_salt_the_block_hashes() -> None:
    old, new = random_tiny(0), random_tiny(1)
    engine = LLMEngine(old.model, layout_of(old), 64, old.config.eos_token_ids)
    assert generate_one(engine, "a")[1] == 0
    assert generate_one(engine, "b") == (reference(0, PROMPT, 6), 32)  # the local prefix cache
    old.model.load_state_dict(new.model.state_dict())
    assert engine.new_weights("seed-1@x") >= 2
    assert engine.scheduler.blocks.salt != b""
    assert generate_one(engine, "c") == (reference(1, PROMPT, 6), 0)  # nothing of the old weights
    assert generate_one(engine, "d")[1] == 32  # blocks of the new weights are cached again
    engine.add_request("e", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument, match="drain it"):
        engine.new_weights("seed-2@y")


def stream_of(loop: asyncio.AbstractEventLoop, request_id: str) -> RequestStream:
    return RequestStream(request_id, loop, asyncio.Queue(), len(PROMPT))


def test_a_pause_drains_running_requests_and_holds_new_ones() -> None:
    loaded = random_tiny(0)

    def make() -> LLMEngine:
        return LLMEngine(loaded.model, layout_of(loaded), 64, loaded.config.eos_token_ids)

    thread = EngineThread(make, WorkerMetrics(), 1, "pause-test")
    seen: list[tuple[str, bool]] = []  # (what, engine had work) in order
    loop = asyncio.new_event_loop()
    try:
        running, held = stream_of(loop, "running"), stream_of(loop, "held")
        gate = threading.Event()
        thread.submit(AddCommand(tuple(PROMPT), SamplingParams(max_tokens=40, ignore_eos=True), running))

        def action(engine: LLMEngine) -> None:
            seen.append(("action", engine.has_work()))
            gate.set()

        done: Future[None] = Future()
        thread.submit(PauseCommand(action, done, drain_timeout_s=30))
        thread.submit(AddCommand(tuple(PROMPT), SamplingParams(max_tokens=2), held))
        thread.start()
        done.result(timeout=30)
        assert seen == [("action", False)]  # run on the drained engine
        events = loop.run_until_complete(drain(running, 41)) + loop.run_until_complete(drain(held, 3))
        assert [e for e in events if isinstance(e, Verdict) and e.error is not None] == []
    finally:
        thread.close()
        loop.close()


async def drain(stream: RequestStream, count: int) -> list[object]:
    """The stream's first `count` events (verdict, then outputs)."""
    return [await asyncio.wait_for(stream.queue.get(), 30) for _ in range(count)]


def test_a_pause_fails_requests_still_running_at_its_drain_timeout() -> None:
    loaded = random_tiny(0)
    thread = EngineThread(
        lambda: LLMEngine(loaded.model, layout_of(loaded), 64, loaded.config.eos_token_ids), WorkerMetrics(), 1, "t"
    )
    loop = asyncio.new_event_loop()
    try:
        slow = stream_of(loop, "slow")
        thread.submit(AddCommand(tuple(PROMPT), SamplingParams(max_tokens=900, ignore_eos=True), slow))
        done: Future[None] = Future()
        thread.submit(PauseCommand(lambda engine: None, done, drain_timeout_s=0.05))
        thread.start()
        done.result(timeout=30)
        errors = loop.run_until_complete(errors_of(slow))
        assert len(errors) == 1 and isinstance(errors[0], WorkerUnavailable) and "weight update" in str(errors[0])
    finally:
        thread.close()
        loop.close()
    closed: Future[None] = Future()
    with pytest.raises(ClosedError):
        thread.submit(PauseCommand(lambda engine: None, closed))


async def errors_of(stream: RequestStream) -> list[Exception]:
    """Read `stream` up to its first error (after the acceptance verdict)."""
    while True:
        event = await asyncio.wait_for(stream.queue.get(), 30)
        if isinstance(event, Verdict) and event.error is not None:
            return [event.error]


@pytest.fixture
def metadata_url() -> str:
    return f"memory://update-weights-{uuid.uuid4().hex}"


@pytest.fixture
def publisher(metadata_url: str) -> Iterator[P2PStore]:
    with P2PStore(Config(metadata=MetadataConfig(url=metadata_url))) as store:
        yield store


def start_worker(metadata_url: str) -> Worker:
    config = WorkerConfig(
        name="colo", model="tiny", block_tokens=BLOCK_TOKENS, num_blocks=64, metadata_url=metadata_url
    )
    return Worker(config, random_tiny(0)).start()


def generate(url: str, request_id: str, max_tokens: int = 6) -> tuple[list[int], int]:
    body = {"request_id": request_id, "prompt_ids": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.stream("POST", url + "/generate", json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        lines = [json.loads(line) for line in response.iter_lines() if line]
    return [t for line in lines for t in line["token_ids"]], lines[-1]["cached_tokens"]


def update(url: str, body: object, secret: str | None = None) -> httpx.Response:
    with httpx.Client(timeout=60) as client:
        request = client.build_request("POST", url + "/admin/update_weights", content=json.dumps(body).encode())
        return client.send(httpd.sign_request(request, secret.encode() if secret else None))


def test_a_worker_swaps_in_published_weights_and_keeps_the_old_ones_on_errors(
    metadata_url: str, publisher: P2PStore
) -> None:
    new, other = random_tiny(1), random_tiny(2, num_layers=2)
    publish_state_dict(publisher, "tiny-seed-1", new.model.state_dict())
    publish_state_dict(publisher, "two-layers", other.model.state_dict())
    old_tokens = reference(0, PROMPT, 6)
    with start_worker(metadata_url) as worker:
        url = worker.base_url
        assert generate(url, "before") == (old_tokens, 0)
        assert generate(url, "cached") == (old_tokens, 32)
        missing = update(url, {"name": "no-such-weights"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "payload_not_found"
        mismatch = update(url, {"name": "two-layers"})
        assert mismatch.status_code == 400 and "do not match" in mismatch.json()["error"]["message"]
        for bad in ({}, {"name": ""}, {"name": 3}, {"name": "x", "drain_timeout_s": 0}):
            assert update(url, bad).status_code == 400, bad
        assert generate(url, "still-old") == (old_tokens, 32)  # the old weights and cache are intact
        assert httpx.get(url + "/health").json()["weights_version"] == "initial"

        reply = update(url, {"name": "tiny-seed-1"})
        assert reply.status_code == 200, reply.text
        version = reply.json()["weights_version"]
        assert version.startswith("tiny-seed-1@") and reply.json()["seconds"] > 0
        new_tokens = reference(1, PROMPT, 6)
        assert new_tokens != old_tokens
        assert generate(url, "after") == (new_tokens, 0)  # no block of the old weights reused
        assert generate(url, "after-cached") == (new_tokens, 32)
        assert httpx.get(url + "/health").json()["weights_version"] == version
        again = update(url, {"name": "tiny-seed-1"})  # the same bytes: the same version
        assert again.json()["weights_version"] == version
        # a PD request whose first token came from the old weights does not continue on the new
        stale = {"request_id": "stale", "prompt_ids": PROMPT, "max_tokens": 2, "weights_version": "initial"}
        refused = httpx.post(url + "/generate", json=stale, timeout=30)
        assert refused.status_code == 503 and "the weights changed" in refused.json()["error"]["message"]
        current = httpx.post(url + "/generate", json={**stale, "weights_version": version}, timeout=30)
        assert {json.loads(line)["weights_version"] for line in current.text.splitlines()} == {version}
    assert publisher.list()[0].replica_counts == [1] * len(publisher.list()[0].replica_counts)  # replica withdrawn


def test_without_a_metadata_service_an_update_is_refused() -> None:
    with Worker(WorkerConfig(name="colo", model="tiny", num_blocks=64), random_tiny(0)).start() as worker:
        reply = update(worker.base_url, {"name": "anything"})
        assert reply.status_code == 400 and "--metadata-url" in reply.json()["error"]["message"]


def test_with_the_cluster_secret_an_update_must_be_signed(metadata_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TSUKIMI_CLUSTER_SECRET", SECRET)
    with start_worker(metadata_url) as worker:
        unsigned = update(worker.base_url, {"name": "anything"})
        assert unsigned.status_code == 401
        wrong = update(worker.base_url, {"name": "anything"}, secret="another-secret-of-enough-bytes")
        assert wrong.status_code == 401
        signed = update(worker.base_url, {"name": "anything"}, secret=SECRET)
        assert signed.status_code == 404  # past the check: no such payload
