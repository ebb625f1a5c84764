"""Tokenizers: text <-> token ids, chat templates, and streaming detokenization.

This module owns the `Tokenizer` protocol and its two implementations: `BpeTokenizer` (byte-level
BPE on the `tokenizers` library, built from a GGUF file's tokenizer.ggml.* metadata or a Hugging
Face tokenizer.json) and `ByteTokenizer` (one token per UTF-8 byte, for the random tiny model).
Chat templates are Jinja run in a sandbox (as Hugging Face does); `StreamDecoder` turns ids into
text piece by piece without ever emitting half of a multi-byte character.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn, Protocol

from gguf import GGUFReader
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tsukimi.engine.weights import MODEL_SPECS, default_gguf_path, gguf_eos_token_ids, open_gguf
from tsukimi.errors import ConfigError, InvalidArgument

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
GGUF_PRE_TOKENIZERS = ("default", "gpt2", *_DIGITS_THEN_GPT2)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class Tokenizer(Protocol):
    """What the engine and the server need of a tokenizer. `eos_token_ids` end generation; the
    first is the model's own end-of-sequence token."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids. `add_bos` None
        follows the model's convention."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation of {"role", "content"} messages."""
        ...


def _raise_exception(message: str) -> NoReturn:
    raise InvalidArgument(f"chat template: {message}")


class ChatTemplate:
    """A Jinja chat template in an immutable sandbox (HF's environment: trim_blocks, lstrip_blocks)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ConfigError(f"invalid chat template: {e}") from e
        self.source, self._bos_token, self._eos_token = source, bos_token, eos_token

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Renders the conversation. Pure.

        Raises:
            InvalidArgument: a message without a string role and content, or the template refused it.
        """
        for message in messages:
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise InvalidArgument(f"chat message {message!r} needs string 'role' and 'content'")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except TemplateError as e:
            raise InvalidArgument(f"chat template failed: {e}") from e


class BpeTokenizer:
    """A `tokenizers.Tokenizer` (byte-level BPE) with the model's special tokens and chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id, self.eos_token_ids, self.add_bos = bos_token_id, eos_token_ids, add_bos  # eos first
        if chat_template is None:
            logger.info("the tokenizer has no chat template; using ChatML")
        bos = "" if bos_token_id is None else backend.id_to_token(bos_token_id) or ""
        eos = backend.id_to_token(eos_token_ids[0]) or "" if eos_token_ids else ""
        self.chat_template = ChatTemplate(chat_template or CHATML_TEMPLATE, bos, eos)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        bos_first = self.add_bos if add_bos is None else add_bos
        if bos_first and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt)


def _gguf_get(reader: GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def tokenizer_from_gguf(path: Path | str) -> BpeTokenizer:
    """Builds the tokenizer stored in a GGUF file's metadata (byte-level BPE, "gpt2" model).

    Raises:
        ConfigError: no such file, or a tokenizer model or pre-tokenizer we do not implement.
    """
    path = Path(path)
    reader = open_gguf(path)
    kind, pre = _gguf_get(reader, "tokenizer.ggml.model"), _gguf_get(reader, "tokenizer.ggml.pre") or "default"
    if kind != "gpt2":
        raise ConfigError(f"{path}: tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ConfigError(f"{path}: pre-tokenizer {pre!r} is not supported; known: {', '.join(GGUF_PRE_TOKENIZERS)}")
    tokens, merges = _gguf_get(reader, "tokenizer.ggml.tokens"), _gguf_get(reader, "tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ConfigError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens or merges")
    types = _gguf_get(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if not isinstance(types, list) or len(types) != len(tokens) or any(len(p) != 2 for p in pairs):
        raise ConfigError(f"{path}: malformed tokenizer.ggml.token_type or merges")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[(p[0], p[1]) for p in pairs])
    backend = HFTokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    kinds = dict(zip(tokens, types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds.items() if k == _CONTROL]
    )
    backend.add_tokens([AddedToken(t, normalized=False) for t, k in kinds.items() if k == _USER_DEFINED])
    bos = _gguf_get(reader, "tokenizer.ggml.bos_token_id")
    template = _gguf_get(reader, "tokenizer.chat_template")
    return BpeTokenizer(
        backend,
        bos if isinstance(bos, int) else None,
        gguf_eos_token_ids(reader),
        add_bos=bool(_gguf_get(reader, "tokenizer.ggml.add_bos_token")),
        chat_template=template if isinstance(template, str) else None,
    )


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_from_hf_dir(path: Path | str) -> BpeTokenizer:
    """Loads tokenizer.json (and tokenizer_config.json for special tokens and the chat template).

    Raises:
        ConfigError: no tokenizer.json there, or an unreadable one.
    """
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{path} has no tokenizer.json")
    try:
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except Exception as e:  # NOTE: tokenizers raises a bare Exception for a malformed file
        raise ConfigError(f"{path}: unreadable tokenizer files: {e}") from e
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    bos_text, eos_text = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    bos = None if bos_text is None else backend.token_to_id(bos_text)
    eos = None if eos_text is None else backend.token_to_id(eos_text)
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # the post-processor decides, as in transformers
        add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
    return BpeTokenizer(
        backend, bos, () if eos is None else (eos,), bool(add_bos), template if isinstance(template, str) else None
    )


class ByteTokenizer:
    """One token per UTF-8 byte (id = byte + 4) after four ChatML-style special tokens, for the
    random tiny model. Ids above the bytes (the model may sample any of `vocab_size`) decode as
    printable ASCII, so that a random model's output is visible text."""

    SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")
    BYTE_OFFSET = len(SPECIAL_TOKENS)

    def __init__(self, vocab_size: int = 32000) -> None:
        if vocab_size < self.BYTE_OFFSET + 256:
            raise ConfigError(f"a byte tokenizer needs vocab_size >= {self.BYTE_OFFSET + 256}, got {vocab_size}")
        self.vocab_size, self.bos_token_id, self.eos_token_ids = vocab_size, 1, (2,)
        self.chat_template = ChatTemplate(CHATML_TEMPLATE, "<|im_start|>", "<|im_end|>")
        self._special = re.compile("|".join(re.escape(t) for t in self.SPECIAL_TOKENS))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = [self.bos_token_id] if add_bos else []
        start = 0
        for match in self._special.finditer(text):
            ids += [b + self.BYTE_OFFSET for b in text[start : match.start()].encode()]
            ids.append(self.SPECIAL_TOKENS.index(match.group()))
            start = match.end()
        return ids + [b + self.BYTE_OFFSET for b in text[start:].encode()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise InvalidArgument(f"token id {token} is outside 0..{self.vocab_size - 1}")
            if self.BYTE_OFFSET <= token < self.BYTE_OFFSET + 256:
                pending.append(token - self.BYTE_OFFSET)
                continue
            out.append(pending.decode(errors="replace"))
            pending.clear()
            if token >= self.BYTE_OFFSET + 256:
                out.append(chr(32 + (token - self.BYTE_OFFSET - 256) % 95))
            elif not skip_special_tokens:
                out.append(self.SPECIAL_TOKENS[token])
        return "".join(out) + pending.decode(errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt)


class StreamDecoder:
    """Incremental detokenization for streaming: `push` new ids, get the text they complete.

    Text is emitted only when it no longer ends in U+FFFD (an unfinished UTF-8 sequence); the
    decoded window starts a few tokens back so that tokenizers that merge across tokens (spaces,
    byte fallback) see context. Mutable, one per sequence.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = self._read_offset = 0

    def push(self, new_ids: Sequence[int]) -> str:
        """Appends `new_ids`; returns the text they complete ("" while a character is unfinished)."""
        self.ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back at the end of the sequence (replacement characters included)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(self.ids[self._prefix_offset : self._read_offset], skip)
        text = decode(self.ids[self._prefix_offset :], skip)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return text[len(prefix) :]


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer for a model spec (see weights.load_model): "tiny[:SEED]", "smollm2",
    "random:PRESET[:SEED]" (random weights: bytes, as tiny), a .gguf path or a Hugging Face directory.

    Raises:
        ConfigError: an unknown spec, or the loader's errors.
    """
    if spec == "tiny" or spec.startswith(("tiny:", "random:")):
        return ByteTokenizer()
    path = default_gguf_path() if spec == "smollm2" else Path(spec)
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    if path.is_dir():
        return tokenizer_from_hf_dir(path)
    raise ConfigError(f"model spec {spec!r} is none of {', '.join(MODEL_SPECS)}")
