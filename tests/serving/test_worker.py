"""The inference worker's HTTP API: a colocated worker in this process (same tokens as the
engine alone, input errors, duplicate ids, client disconnects, concurrency, engine failures),
and a prefill and a decode worker sharing a real store master (a subprocess) as the KV pool."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from tsukimi.config import WorkerConfig
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel
from tsukimi.errors import ConfigError
from tsukimi.serving.worker.server import Worker
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.processes import wait_until

BLOCK_TOKENS = 16
PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks and a partial one
POISON = 31999  # FailingModel raises on this token


@pytest.fixture(scope="module")
def colocated(tiny: LoadedModel) -> Iterator[Worker]:
    with Worker(WorkerConfig(name="colo", role="colocated", model="tiny", num_blocks=512), tiny).start() as worker:
        yield worker


def reference(tiny: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from a plain LLMEngine."""
    c = tiny.config
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK_TOKENS, c.torch_dtype)
    engine = LLMEngine(tiny.model, layout, 64, c.eos_token_ids)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]


def body(request_id: str, prompt: list[int], max_tokens: int = 8, **extra: object) -> dict[str, object]:
    return {"request_id": request_id, "prompt_ids": prompt, "max_tokens": max_tokens, **extra}


def generate(url: str, payload: dict[str, object]) -> list[dict[str, object]]:
    """POST /generate; the NDJSON lines, parsed."""
    with httpx.stream("POST", url + "/generate", json=payload, timeout=30) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.iter_lines() if line]


def tokens(lines: list[dict[str, object]]) -> list[int]:
    return [t for line in lines for t in line["token_ids"]]  # type: ignore[attr-defined]


def test_health_and_load(colocated: Worker, tiny: LoadedModel) -> None:
    health = httpx.get(colocated.base_url + "/health", timeout=5).json()
    events_ports = health.pop("kv_events_port"), health.pop("kv_snapshot_port")  # NOTE: ephemeral
    assert all(port > 0 for port in events_ports)
    cost = health.pop("cost")  # NOTE: the start-up profile (tests/serving/test_worker_costs.py)
    assert len(cost["prefill_coef"]) == len(cost["decode_coef"]) == 3 and cost["seconds"] > 0
    assert health == {
        "status": "ok",
        "name": "colo",
        "role": "colocated",
        "model": tiny.config.identity,
        "model_name": "random-tiny",
        "block_tokens": BLOCK_TOKENS,
        "weights_version": "initial",
        "cpp": None,
    }
    load = httpx.get(colocated.base_url + "/load", timeout=5).json()
    assert load["waiting"] == load["running"] == 0 and load["total_blocks"] == 512
    assert 0 < load["free_blocks"] <= 512


def test_generate_streams_the_engines_greedy_tokens(colocated: Worker, tiny: LoadedModel) -> None:
    lines = generate(colocated.base_url, body("greedy", PROMPT, max_tokens=12, ignore_eos=True))
    assert tokens(lines) == reference(tiny, PROMPT, 12)
    assert [line["finish_reason"] for line in lines[:-1]] == [None] * (len(lines) - 1)
    assert lines[-1]["finish_reason"] == "length"
    again = generate(colocated.base_url, body("greedy-again", PROMPT, max_tokens=2))
    assert again[-1]["cached_tokens"] == 32 and again[-1]["pool_tokens"] == 0  # the local prefix cache
    metrics = httpx.get(colocated.base_url + "/metrics", timeout=5).text
    assert "tsukimi_worker_local_prompt_tokens_total" in metrics
    assert 'tsukimi_worker_requests_total{finish_reason="length"}' in metrics


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b'{"prompt_ids": [1, 2]}',  # no request_id
        b'{"request_id": "x", "prompt_ids": "1 2"}',
        b'{"request_id": "x", "prompt_ids": [1], "colour": "red"}',  # unknown field
        b'{"request_id": "x", "prompt_ids": []}',  # the engine refuses an empty prompt
        b'{"request_id": "x", "prompt_ids": [1], "max_tokens": 0}',  # SamplingParams refuses it
        b'{"request_id": "x", "prompt_ids": [1], "top_p": 0}',
        b'{"request_id": "x", "prompt_ids": [32000]}',  # outside the vocabulary
        b'{"request_id": "", "prompt_ids": [1]}',
        b'{"request_id": "x", "prompt_ids": [1], "max_tokens": 60000}',  # beyond the KV cache
    ],
)
def test_bad_input_is_400(colocated: Worker, payload: bytes) -> None:
    response = httpx.post(colocated.base_url + "/generate", content=payload, timeout=5)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_argument" and error["message"]


def long_request(request_id: str) -> dict[str, object]:
    return body(request_id, PROMPT, max_tokens=4000, ignore_eos=True)  # ~20 s of decoding


def wait_idle(url: str) -> None:
    wait_until(lambda: (lambda load: load["waiting"] + load["running"] == 0)(httpx.get(url + "/load").json()), 10)


def test_duplicate_running_id_is_409(colocated: Worker) -> None:
    with httpx.stream("POST", colocated.base_url + "/generate", json=long_request("dup"), timeout=30) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # NOTE: keep it: a discarded line iterator closes the connection
        next(lines)
        second = httpx.post(colocated.base_url + "/generate", json=body("dup", [1, 2, 3]), timeout=5)
        assert second.status_code == 409
        assert second.json()["error"] == {"code": "duplicate_request", "message": "request 'dup' is already running"}
    wait_idle(colocated.base_url)
    assert tokens(generate(colocated.base_url, body("dup", [1, 2, 3], max_tokens=1))) != []  # the id is free again


def metric(url: str, sample: str) -> float:
    """The value of one sample line of the worker's /metrics (0 when absent)."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_client_disconnect_aborts_the_request(colocated: Worker) -> None:
    aborted = 'tsukimi_worker_requests_total{finish_reason="abort"}'
    before = metric(colocated.base_url, aborted)
    with httpx.stream("POST", colocated.base_url + "/generate", json=long_request("gone"), timeout=30) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines))["finish_reason"] is None
        load = httpx.get(colocated.base_url + "/load", timeout=5).json()
        assert load["waiting"] + load["running"] == 1
    wait_idle(colocated.base_url)  # long before its 4000 tokens would be done
    assert metric(colocated.base_url, aborted) == before + 1


def test_concurrent_requests_both_complete(colocated: Worker, tiny: LoadedModel) -> None:
    prompts = [list(range(200, 230)), list(range(5000, 5050))]

    async def both() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=colocated.base_url, timeout=30) as client:

            async def one(i: int) -> list[int]:
                payload = body(f"conc-{i}", prompts[i], max_tokens=10, ignore_eos=True)
                async with client.stream("POST", "/generate", json=payload) as response:
                    return tokens([json.loads(line) async for line in response.aiter_lines() if line])

            return list(await asyncio.gather(one(0), one(1)))

    assert asyncio.run(both()) == [reference(tiny, p, 10) for p in prompts]


class FailingModel(torch.nn.Module):
    """The tiny model, except that a forward over POISON raises."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: object) -> torch.Tensor:
        if bool((token_ids == POISON).any()):
            raise RuntimeError("boom")
        return self.inner(token_ids, positions, attend)  # type: ignore[no-any-return]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(hidden)  # type: ignore[operator,no-any-return]


def test_engine_failure_fails_its_requests_and_the_worker_goes_on(tiny: LoadedModel) -> None:
    broken = LoadedModel(tiny.config, FailingModel(tiny.model), tiny.source)  # type: ignore[arg-type]
    with Worker(WorkerConfig(name="broken", model="tiny", num_blocks=64), broken).start() as worker:
        lines = generate(worker.base_url, body("poisoned", [1, POISON, 3]))
        assert lines[-1]["finish_reason"] is None
        assert lines[-1]["error"] == {
            "code": "worker_error",
            "message": "the engine failed on this request: RuntimeError: boom",
        }
        assert tokens(generate(worker.base_url, body("fine", PROMPT, max_tokens=4, ignore_eos=True))) == reference(
            tiny, PROMPT, 4
        )


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="role"):
        WorkerConfig(role="mixed")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="master"):
        WorkerConfig(role="decode")
    with pytest.raises(ConfigError, match="num_blocks"):
        WorkerConfig(num_blocks=-1)
    with pytest.raises(ConfigError, match="memory budget"):
        WorkerConfig(kv_cache_memory="lots")


def test_prefill_then_decode_through_the_kv_pool(tiny: LoadedModel, colocated: Worker) -> None:
    with TsukimiCluster(holder_bytes=0, num_holders=0) as store:
        pool = {"model": "tiny", "master": store.master_addr, "segment_bytes": 16 << 20, "num_blocks": 64}
        with (
            Worker(WorkerConfig(name="p", role="prefill", **pool), tiny).start() as prefill,  # type: ignore[arg-type]
            Worker(WorkerConfig(name="d", role="decode", **pool), tiny).start() as decode,  # type: ignore[arg-type]
        ):
            first = generate(prefill.base_url, body("pd", PROMPT, max_tokens=12, ignore_eos=True))
            assert len(first) == 1 and first[0]["finish_reason"] == "length" and len(tokens(first)) == 1
            assert first[0]["cached_tokens"] == first[0]["pool_tokens"] == 0
            rest = generate(decode.base_url, body("pd", PROMPT + tokens(first), max_tokens=11, ignore_eos=True))
            assert rest[0]["pool_tokens"] == rest[0]["cached_tokens"] == 32  # both full prompt blocks
            assert tokens(first) + tokens(rest) == reference(tiny, PROMPT, 12)
            colocated_lines = generate(colocated.base_url, body("pd-colo", PROMPT, max_tokens=12, ignore_eos=True))
            assert tokens(first) + tokens(rest) == tokens(colocated_lines)
            assert metric(decode.base_url, "tsukimi_worker_pool_prompt_tokens_total") == 32
            assert metric(decode.base_url, "tsukimi_worker_local_prompt_tokens_total") == 0
