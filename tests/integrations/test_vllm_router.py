"""`tsukimi router --backend vllm` over fake vLLM servers (tests/integrations/fake_vllm.py):
placement follows the prefix index fed by the instances' KV events, 429s, the PD two-step with
kv_transfer_params, streaming passed through as it comes, text prompts through /tokenize."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
import zmq

from tests.integrations.fake_vllm import BLOCK_SIZE, CHUNK_DELAY_S, FakeVllm
from tsukimi.config import ConductorConfig
from tsukimi.httpd import start_in_thread
from tsukimi.integrations.vllm.backend import VllmBackend, VllmInstance, VllmRouterConfig
from tsukimi.integrations.vllm.block_hash import VllmHashConfig
from tsukimi.integrations.vllm.kv_events import EventSource
from tsukimi.integrations.vllm.proxy import create_app
from tsukimi.testing.processes import wait_until

Cluster = tuple[str, dict[str, FakeVllm], VllmBackend]


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Fake instances named by the test's marker args ("v0=colocated", ...) behind a router."""
    marker = request.node.get_closest_marker("instances")
    specs = marker.args if marker else ("v0=colocated", "v1=colocated")
    options = marker.kwargs if marker else {}
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with ExitStack() as stack:
        fakes, instances = {}, []
        for spec in specs:
            name, role = spec.split("=")
            fake = fakes[name] = FakeVllm(name, context, waiting=options.get("waiting", 0))
            handle = stack.enter_context(start_in_thread(fake.app))
            instances.append(VllmInstance(name, role, handle.base_url, EventSource(fake.endpoint, "kv")))  # type: ignore[arg-type]
        config = VllmRouterConfig(
            VllmHashConfig(block_size=BLOCK_SIZE),
            poll_interval_s=0.05,
            max_waiting_requests=options.get("max_waiting", 0),
        )
        backend = VllmBackend(instances, config, conductor=options.get("conductor"))
        router = stack.enter_context(start_in_thread(create_app(backend)))
        httpx.post(f"{router.base_url}/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=10)
        wait_until(lambda: httpx.get(f"{router.base_url}/health").status_code == 200, 10)
        yield router.base_url, fakes, backend
        for fake in fakes.values():
            fake.pub.close(linger=0)
    context.term()


def _complete(url: str, prompt: list[int] | str, **extra: object) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2, **extra}, timeout=10
    )


def _served_by(fakes: dict[str, FakeVllm], prompt: list[int]) -> list[str]:
    return [name for name, fake in fakes.items() if any(b.get("prompt") == prompt for b in fake.bodies)]


def test_placement_follows_the_index(cluster: Cluster) -> None:
    url, fakes, backend = cluster
    prefixes = {name: list(range(100 * (i + 1), 100 * (i + 1) + 4 * BLOCK_SIZE)) for i, name in enumerate(fakes)}
    for name, prefix in prefixes.items():  # warm each instance's cache directly, not through the router
        assert httpx.post(f"{_url_of(backend, name)}/v1/completions", json={"prompt": prefix}).status_code == 200
    wait_until(
        lambda: all(backend.index.match_at(f"{n}/hbm", backend.hasher.keys(p)) == 4 for n, p in prefixes.items()), 5
    )
    for round_ in range(3):
        for name, prefix in prefixes.items():
            prompt = [*prefix, 7, round_]
            assert _complete(url, prompt).status_code == 200
            assert _served_by(fakes, prompt) == [name]
    assert backend.stats()["counters"] == {"accepted": 7}  # 6 here and the fixture's probe


def _url_of(backend: VllmBackend, name: str) -> str:
    return backend.instances[name].spec.url


@pytest.mark.instances("v0=colocated", conductor=ConductorConfig(ttft_slo_s=1e-9, rejection="baseline"))
def test_ttft_slo_rejection_is_429(cluster: Cluster) -> None:
    url, fakes, _ = cluster
    response = _complete(url, [1, 2, 3, 4, 5])
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "ttft_slo"
    assert not any(b.get("prompt") == [1, 2, 3, 4, 5] for b in fakes["v0"].bodies)


@pytest.mark.instances("v0=colocated", "v1=colocated", waiting=5, max_waiting=2)
def test_full_queues_are_429(cluster: Cluster) -> None:
    url, _, backend = cluster
    wait_until(lambda: all(s.waiting == 5 for s in backend.instances.values()), 5)
    response = _complete(url, [9, 9])
    assert (response.status_code, response.json()["error"]["code"]) == (429, "queue_full")


@pytest.mark.instances("p0=prefill", "d0=decode")
def test_pd_two_steps_with_kv_transfer_params(cluster: Cluster) -> None:
    url, fakes, _ = cluster
    prompt = list(range(50, 70))
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        timeout=10,
        json={
            "model": "m",
            "prompt": prompt,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        assert response.status_code == 200
        text = response.read().decode()
    [first] = [b for b in fakes["p0"].bodies if b.get("prompt") == prompt]
    assert (first["max_tokens"], first["stream"], first["kv_transfer_params"]["do_remote_decode"]) == (1, False, True)
    assert "stream_options" not in first
    [second] = [b for b in fakes["d0"].bodies if b.get("prompt") == prompt]
    assert second["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "remote_engine_id": "p0",
        "remote_block_ids": [1, 2],
        "remote_host": "127.0.0.1",
    }
    assert (second["max_tokens"], second["stream"]) == (3, True)
    assert text == b"".join(fakes["d0"].chunks(second)).decode()


def test_stream_is_passed_through_as_it_comes(cluster: Cluster) -> None:
    url, fakes, _ = cluster
    body = {"model": "m", "prompt": [3, 1, 4], "max_tokens": 5, "stream": True}
    stamps, data = [], b""
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as response:
        for chunk in response.iter_bytes():
            stamps.append(time.perf_counter() - start)
            data += chunk
    [served] = _served_by(fakes, [3, 1, 4])
    assert data == b"".join(fakes[served].chunks(body))
    # 6 chunks CHUNK_DELAY_S apart: the first arrives long before the last (nothing is buffered)
    assert stamps[0] < 2.5 * CHUNK_DELAY_S < 5 * CHUNK_DELAY_S <= stamps[-1]


def test_text_prompts_are_tokenized_by_an_instance(cluster: Cluster) -> None:
    url, fakes, backend = cluster
    text = "abcdefghijklmnop"  # the fake tokenizes by characters: 4 blocks
    httpx.post(f"{_url_of(backend, 'v1')}/v1/completions", json={"prompt": text})
    keys = backend.hasher.keys([ord(c) for c in text])
    wait_until(lambda: backend.index.match_at("v1/hbm", keys) == 4, 5)
    assert _complete(url, text + "q").status_code == 200
    assert [n for n, f in fakes.items() if any(b.get("prompt") == text + "q" for b in f.bodies)] == ["v1"]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 200 and json.loads(chat.text)["choices"][0]["text"] in fakes
