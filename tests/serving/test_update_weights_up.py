"""A live weight update of a whole `tsukimi up` cluster (real processes: master, metadata server,
a prefill and a decode worker, the router): new tiny-model weights published from this process
through the P2P store, one POST to the router's /admin/update_weights, and every worker's greedy
output is then exactly a fresh engine's on the new weights, with no restart; no block computed
with the old weights is reused, neither from a worker's prefix cache nor from the KV pool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.test_cluster import running, tiny_cluster
from tests.serving.test_update_weights import PROMPT, reference
from tsukimi.config import Config, MetadataConfig
from tsukimi.engine.tokenizer import load_tokenizer
from tsukimi.engine.weights import random_tiny
from tsukimi.p2p import P2PStore
from tsukimi.p2p.weights import publish_state_dict
from tsukimi.testing.processes import wait_until

MAX_TOKENS = 6


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A PD cluster of the tiny model; every process's URL by name, and "api"."""
    monkeypatch.delenv("TSUKIMI_CLUSTER_SECRET", raising=False)
    with running(tmp_path, tiny_cluster(tmp_path)) as state:
        yield {"api": state["api"], **{p["name"]: p["url"] for p in state["processes"]}}  # type: ignore[attr-defined]


def generate(url: str, request_id: str) -> tuple[list[int], int, int]:
    """A worker's greedy tokens for PROMPT, its cached prompt tokens and those from the pool."""
    body = {"request_id": request_id, "prompt_ids": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with httpx.stream("POST", url + "/generate", json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        lines = [json.loads(line) for line in response.iter_lines() if line]
    return [t for line in lines for t in line["token_ids"]], lines[-1]["cached_tokens"], lines[-1]["pool_tokens"]


def complete(api: str) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    response = httpx.post(api + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


def prompt_details(api: str) -> tuple[int, int]:
    """One completion's cached prompt tokens and those the router's index expected (its
    decision record, by the request's X-Request-Id)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    response = httpx.post(api + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    [record] = httpx.get(api + "/decisions", params={"request_id": response.headers["x-request-id"]}).json()[
        "decisions"
    ]
    assert record["cached_tokens"] == response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return record["cached_tokens"], record["expected_cached_tokens"]


@pytest.mark.timeout(120)
def test_up_updates_every_workers_weights_live(cluster: dict[str, str]) -> None:
    prefill, decode = cluster["prefill-0"], cluster["decode-0"]
    old, new = reference(0, PROMPT, MAX_TOKENS), reference(1, PROMPT, MAX_TOKENS)
    assert old != new
    assert generate(prefill, "p-old") == (old[:1], 0, 0)  # publishes the prompt's blocks to the pool
    assert generate(decode, "d-old") == (old, 32, 32)  # ... which the decode worker loads
    assert generate(prefill, "p-old-again") == (old[:1], 32, 0)  # the local prefix cache
    before = complete(cluster["api"])
    tokenizer = load_tokenizer("tiny")
    assert before == tokenizer.decode(old)

    config = Config(metadata=MetadataConfig(url=cluster["metadata"] + "/metadata"))
    with P2PStore(config) as publisher:
        publish_state_dict(publisher, "tiny-seed-1", random_tiny(1).model.state_dict())
        reply = httpx.post(cluster["api"] + "/admin/update_weights", json={"name": "tiny-seed-1"}, timeout=60)
        assert reply.status_code == 200, reply.text
        versions = {name: r["weights_version"] for name, r in reply.json()["workers"].items()}
        assert sorted(versions) == ["decode-0", "prefill-0"]
        assert len(set(versions.values())) == 1 and versions["decode-0"].startswith("tiny-seed-1@")
        for name in versions:
            assert httpx.get(cluster[name] + "/health").json()["weights_version"] == versions[name]
        # NOTE: each worker withdrew its staged copy: only the publisher holds the payload now
        assert set(publisher.list()[0].replica_counts) == {1}

    # the decode worker first: the pool still holds the prompt's blocks of the old weights
    assert generate(decode, "d-new") == (new, 0, 0)
    # the prefill worker's own cache of the old weights was dropped: every reused block comes
    # from the pool, where the decode worker just published them under the new weights version
    assert generate(prefill, "p-new") == (new[:1], 32, 32)
    assert generate(prefill, "p-new-again") == (new[:1], 32, 0)
    assert complete(cluster["api"]) == tokenizer.decode(new) != before
    # the router now hashes as the updated workers do (their version's salt), so its index follows
    # their KV events again and expects the prefill worker's reuse exactly
    wait_until(lambda: prompt_details(cluster["api"]) == (32, 32), timeout_s=10, interval_s=0.2)
    missing = httpx.post(cluster["api"] + "/admin/update_weights", json={"name": "no-such"}, timeout=60)
    assert missing.status_code == 404
    assert {r["code"] for r in missing.json()["workers"].values()} == {"payload_not_found"}
