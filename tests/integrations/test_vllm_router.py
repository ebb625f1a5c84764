"""`tsukimi router --backend vllm` over fake vLLM servers (tests/integrations/fake_vllm.py): the
one router (`build_router_app` with the vLLM backend) placing by the prefix index its KV events
feed, 429s with their decision records, the PD two-step with kv_transfer_params, streams relayed
as they come, text prompts tokenized by the router itself, stop tokens and cached counts."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import zmq

from tests.integrations.fake_vllm import BLOCK_SIZE, CHUNK_DELAY_S, FakeVllm
from tsukimi.clock import WallClock
from tsukimi.config import ROUTER_CONDUCTOR, RouterAppConfig, RouterConfig, VllmBackendConfig
from tsukimi.engine.tokenizer import ByteTokenizer
from tsukimi.errors import ConfigError
from tsukimi.httpd import start_in_thread
from tsukimi.integrations.vllm.backend import VllmBackend, vllm_backend
from tsukimi.serving.router.app import build_router_app
from tsukimi.serving.router.router import Router
from tsukimi.serving.router.workers import parse_workers
from tsukimi.testing.processes import wait_until

TOKENIZER = ByteTokenizer()


@dataclasses.dataclass
class Cluster:
    url: str
    fakes: dict[str, FakeVllm]
    router: Router

    @property
    def backend(self) -> VllmBackend:
        assert isinstance(self.router.backend, VllmBackend)
        return self.router.backend

    def record(self, request_id: str) -> dict[str, object]:
        [record] = httpx.get(f"{self.url}/decisions", params={"request_id": request_id}).json()["decisions"]
        return record  # type: ignore[no-any-return]


def model_dir(tmp_path: Path) -> Path:
    """A served model's folder as far as the router reads it here (its context length; the
    tests pass the byte tokenizer in)."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return tmp_path


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """Fake instances named by the test's marker args ("v0=colocated", ...) behind the router."""
    marker = request.node.get_closest_marker("instances")
    specs = marker.args if marker else ("v0=colocated", "v1=colocated")
    options = marker.kwargs if marker else {}
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with ExitStack() as stack:
        fakes, workers = {}, []
        for spec in specs:
            name, role = spec.split("=")
            fake = fakes[name] = FakeVllm(name, context, waiting=options.get("waiting", 0))
            workers.append(f"{name}={role}@{stack.enter_context(start_in_thread(fake.app)).base_url}")
        events = ",".join(f"{name}={fake.endpoint}" for name, fake in fakes.items())
        config = RouterAppConfig(
            ",".join(workers),
            backend="vllm",
            model=str(model_dir(tmp_path)),
            shed_lag_ms=0,
            router=RouterConfig(poll_interval_s=0.05, max_waiting_requests=options.get("max_waiting", 0)),
            conductor=options.get("conductor", ROUTER_CONDUCTOR),
            vllm=VllmBackendConfig(block_size=BLOCK_SIZE, kv_events=events, pool=options.get("pool", False)),
        )
        app = build_router_app(config, {"vllm": vllm_backend}, TOKENIZER)
        router = stack.enter_context(start_in_thread(app))
        httpx.post(f"{router.base_url}/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=10)
        wait_until(lambda: httpx.get(f"{router.base_url}/health").json()["status"] == "ok", 10)
        yield Cluster(router.base_url, fakes, app.state.server.router)
        for fake in fakes.values():
            fake.pub.close(linger=0)
    context.term()


def _complete(url: str, prompt: list[int] | str, rid: str = "", **extra: object) -> httpx.Response:
    headers = {"X-Request-Id": rid} if rid else {}
    body = {"prompt": prompt, "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)


def _served_by(fakes: dict[str, FakeVllm], prompt: list[int]) -> list[str]:
    return [name for name, fake in fakes.items() if any(b["prompt"] == prompt for b in fake.bodies)]


def test_placement_follows_the_index(cluster: Cluster) -> None:
    url, fakes, router = cluster.url, cluster.fakes, cluster.router
    prefixes = {name: list(range(100 * (i + 1), 100 * (i + 1) + 4 * BLOCK_SIZE)) for i, name in enumerate(fakes)}
    for name, prefix in prefixes.items():  # warm each instance's cache directly, not through the router
        fake_url = next(w.spec.url for w in router._workers.values() if w.name == name)
        assert httpx.post(f"{fake_url}/v1/completions", json={"prompt": prefix}).status_code == 200
    hasher = cluster.backend.hasher
    wait_until(lambda: all(router.index.match_at(f"{n}/hbm", hasher.keys(p)) == 4 for n, p in prefixes.items()), 5)
    for round_ in range(3):
        for name, prefix in prefixes.items():
            prompt = [*prefix, 7, round_]
            response = _complete(url, prompt, f"{name}-{round_}", return_token_ids=True)
            assert response.status_code == 200
            assert _served_by(fakes, prompt) == [name]
            assert response.json()["choices"][0]["token_ids"] == [round_ + 1, round_ + 2]
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK_SIZE
            record = cluster.record(f"{name}-{round_}")
            assert (record["mode"], record["prefill"], record["cached_tokens"]) == ("colocated", name, 4 * BLOCK_SIZE)
            assert isinstance(record["predicted_ttft_s"], float) and isinstance(record["conductor_id"], int)
    assert router.policy == "conductor" and router.conductor is not None
    assert router.conductor.counters == {"accepted": 7}  # 6 here and the fixture's probe


@pytest.mark.instances(
    "v0=colocated", conductor=dataclasses.replace(ROUTER_CONDUCTOR, ttft_slo_s=1e-9, rejection="baseline")
)
def test_ttft_slo_rejection_is_429(cluster: Cluster) -> None:
    response = _complete(cluster.url, [1, 2, 3, 4, 5], "slo")
    assert response.status_code == 429 and response.headers["x-request-id"] == "slo"
    assert response.json()["error"]["code"] == "ttft_slo"
    assert not any(b["prompt"] == [1, 2, 3, 4, 5] for b in cluster.fakes["v0"].bodies)
    record = cluster.record("slo")
    assert (record["accepted"], record["reason"], record["prefill"]) == (False, "ttft_slo", "")


@pytest.mark.instances("v0=colocated", "v1=colocated", waiting=5, max_waiting=2)
def test_full_queues_are_429(cluster: Cluster) -> None:
    wait_until(lambda: all(w.waiting == 5 for w in cluster.router.workers()), 5)
    response = _complete(cluster.url, [9, 9], "full")
    assert (response.status_code, response.json()["error"]["code"]) == (429, "queue_full")
    assert (cluster.record("full")["accepted"], cluster.record("full")["reason"]) == (False, "queue_full")


@pytest.mark.instances("p0=prefill", "d0=decode", pool=True)
def test_pd_two_steps_with_kv_transfer_params(cluster: Cluster) -> None:
    fakes, prompt = cluster.fakes, list(range(50, 70))
    body = {"prompt": prompt, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=10, json=body) as response:
        assert response.status_code == 200
        lines = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        rid = response.headers["x-request-id"]
    [first] = [b for b in fakes["p0"].bodies if b["prompt"] == prompt]
    assert (first["max_tokens"], first["stream"], first["kv_transfer_params"]["do_remote_decode"]) == (1, False, True)
    assert "stream_options" not in first and first["return_token_ids"]
    [second] = [b for b in fakes["d0"].bodies if b["prompt"][:-1] == prompt]
    assert second["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "remote_engine_id": "p0",
        "remote_block_ids": [1, 2],
        "remote_host": "127.0.0.1",
    }
    # NOTE: the router's one PD flow: the decode instance continues from the prefill's token
    assert (second["prompt"], second["max_tokens"], second["stream"]) == ([*prompt, 70], 2, True)
    text = "".join(c["text"] for line in lines for c in line["choices"])
    assert TOKENIZER.encode(text) == [70, 71, 72] and lines[-1]["usage"]["completion_tokens"] == 3
    record = cluster.record(rid)
    assert (record["mode"], record["prefill"], record["decode"]) == ("pd", "p0", "d0")
    assert (record["cached_tokens"], record["pool_tokens"]) == (0, 20)  # its 5 full blocks over the connector
    assert record["expected_cached_tokens"] == 0 and record["expected_pool_tokens"] == 0


def test_stream_is_relayed_as_it_comes(cluster: Cluster) -> None:
    body = {"prompt": [3, 1, 4], "max_tokens": 5, "stream": True, "return_token_ids": True}
    stamps, ids = [], []
    start = time.perf_counter()
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter() - start)
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    assert ids == [5, 6, 7, 8, 9] and len(_served_by(cluster.fakes, [3, 1, 4])) == 1
    # 5 chunks CHUNK_DELAY_S apart: the first arrives long before the last (nothing is buffered)
    assert stamps[0] < 2.5 * CHUNK_DELAY_S < 4 * CHUNK_DELAY_S <= stamps[-1]


def test_text_prompts_are_tokenized_by_the_router(cluster: Cluster) -> None:
    text = "abcdefghijklmnop"  # 16 bytes: 4 blocks
    v1 = next(w.spec.url for w in cluster.router._workers.values() if w.name == "v1")
    httpx.post(f"{v1}/v1/completions", json={"prompt": TOKENIZER.encode(text)})
    keys = cluster.backend.hasher.keys(TOKENIZER.encode(text))
    wait_until(lambda: cluster.router.index.match_at("v1/hbm", keys) == 4, 5)
    assert _complete(cluster.url, text + "q").status_code == 200
    assert _served_by(cluster.fakes, TOKENIZER.encode(text + "q")) == ["v1"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    reply = httpx.post(f"{cluster.url}/v1/chat/completions", json=chat, timeout=10)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_stop_token_ends_the_text_and_is_not_in_it(cluster: Cluster) -> None:
    """vLLM puts the stop token among its output ids; tsukimi's workers do not emit it."""
    response = _complete(cluster.url, [10, 20], max_tokens=8, stop_token_ids=[23], return_token_ids=True)
    choice = response.json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"], response.json()["usage"]["completion_tokens"]) == (
        [21, 22],
        "stop",
        2,
    )


def test_the_backend_factory_checks_its_config(tmp_path: Path) -> None:
    workers = parse_workers("v0=colocated@http://h:1")
    events = VllmBackendConfig(kv_events="v0=tcp://h:2+tcp://h:3")
    with pytest.raises(ConfigError, match="served model's folder"):
        vllm_backend(RouterAppConfig(model="tiny", vllm=events), workers, WallClock())
    with pytest.raises(ConfigError, match=r"names instances that the workers do not: \['v9'\]"):
        bad = VllmBackendConfig(kv_events="v9=tcp://h:2")
        vllm_backend(RouterAppConfig(model=str(tmp_path), vllm=bad), workers, WallClock())
    backend = vllm_backend(RouterAppConfig(model=str(tmp_path), vllm=events), workers, WallClock())
    assert isinstance(backend, VllmBackend) and backend._sources["v0"].replay_endpoint == "tcp://h:3"


def test_vllm_instances_take_no_live_weight_update(cluster: Cluster) -> None:
    response = httpx.post(f"{cluster.url}/admin/update_weights", json={"name": "w1"}, timeout=10)
    assert response.status_code == 400 and "vllm workers take no live weight update" in response.text
