"""Checking an OpenAI request at the API boundary: body bytes -> a `CheckedRequest` (token
ids and sampling values the workers accept), before any worker is contacted.

Every fault is an `InvalidArgument` (HTTP 400) whose `param` names the parameter at fault, as
OpenAI's error bodies do ("messages[1].content[0].type"); another model is `ModelNotFound`
(404, param "model"). What is checked:

- types: msgspec decodes into openai_protocol's structs; its message loses its internal path
  and the path becomes `param`. Fields no struct declares are ignored (as vLLM does).
- values: n = 1; temperature 0 or [1e-6, 2]; top_p [1e-6, 1] (the engine's float32 floor);
  omitted, they are the served model's `GenerationDefaults` (the one place a request takes
  them: tsukimi/engine/generation_defaults.py says which);
  seed 0..2**63-1; stop: at most 4 non-empty strings of at most 1024 characters;
  stop_token_ids and prompt token ids in the tokenizer's vocabulary; stream_options only with
  stream; max_tokens (or max_completion_tokens) >= 1 and prompt + max_tokens within the
  model's context (`ModelLimits`). A default max_tokens (the model's max_new_tokens, else the
  endpoint's) is cut to what the context leaves.
- OpenAI parameters tsukimi does not implement (`UNSUPPORTED`): a 400 naming them unless their
  value is the one that means "off" (logprobs false, best_of 1, tools [] ...).
- prompts: a string or token ids; a list of one prompt is that prompt; a batch of several is a
  400 (send one request per prompt). Chat: roles system, developer (as system), user,
  assistant; text content parts only; the chat template's own refusals name "messages".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from tsukimi.engine.generation_defaults import OPENAI_DEFAULTS, GenerationDefaults
from tsukimi.engine.sampling import MAX_TOKENS_LIMIT, MIN_SAMPLING_VALUE
from tsukimi.engine.tokenizer import Tokenizer
from tsukimi.engine.weights import TINY_CONFIG, default_gguf_path, open_gguf
from tsukimi.errors import ConfigError, InvalidArgument, ModelNotFound
from tsukimi.serving.openai.protocol import ChatMessage, ChatRequest, CompletionRequest, ContentPart, Params

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 2.0  # OpenAI's range
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _off(*values: object) -> Callable[[object], bool]:
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


# NOTE: parameter -> whether its value asks for nothing tsukimi lacks (None: not given)
UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "logprobs": _off(False),
    "top_logprobs": _off(0),
    "echo": _off(False),
    "best_of": _off(1),
    "suffix": _off(""),
    "presence_penalty": _off(0.0),
    "frequency_penalty": _off(0.0),
    "logit_bias": _off({}),
    "response_format": lambda v: v is None or getattr(v, "type", None) == "text",
    "tools": _off([]),
    "tool_choice": _off("none", "auto"),
    "functions": _off([]),
    "function_call": _off("none", "auto"),
    "top_k": _off(-1, 0),
    "min_p": _off(0.0),
    "repetition_penalty": _off(1.0),
    "min_tokens": _off(0),
}


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the served model accepts: token ids in 0..vocab_size-1, prompt + output tokens
    within max_context_tokens."""

    vocab_size: int
    max_context_tokens: int


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request every check passed: what the router asks of a worker, and how to answer."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stops: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool = False


class RequestChecker:
    """Checks request bodies for one served model (pure: no I/O, no state).

    Args:
        tokenizer: the model's (prompts, chat template, vocabulary size).
        model_name: the one id requests may name. limits: the model's vocabulary and context.
        default_chat_max_tokens: for chat requests without max_tokens (unless `defaults` has one).
        defaults: the model's generation defaults, for what a request omits.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        limits: ModelLimits,
        default_chat_max_tokens: int,
        defaults: GenerationDefaults = OPENAI_DEFAULTS,
    ):
        self.tokenizer, self.model_name, self.limits = tokenizer, model_name, limits
        self.default_chat_max_tokens, self.defaults = default_chat_max_tokens, defaults

    def check(self, raw: bytes, chat: bool) -> CheckedRequest:
        """The checked request of body `raw` (chat: /v1/chat/completions).

        Raises:
            InvalidArgument: anything wrong, with `param` where one parameter is at fault;
            ModelNotFound: the body names another model.
        """
        req = decode_body(raw, chat)
        if req.model is not None and req.model != self.model_name:
            message = f"the model {req.model!r} does not exist; this server serves {self.model_name!r}"
            raise ModelNotFound(message, "model")
        _check_unsupported(req)
        temperature, top_p = _check_sampling(req, self.defaults)
        stops = _stops(req.stop)
        stop_token_ids = tuple(req.stop_token_ids or ())
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_token_ids)}", "stop_token_ids"
            )
        self._check_ids(stop_token_ids, "stop_token_ids")
        if req.stream_options is not None and not req.stream:
            raise InvalidArgument("stream_options is only allowed when stream is true", "stream_options")
        if isinstance(req, ChatRequest):
            prompt, prompt_param = self._chat_prompt(req.messages), "messages"
            given, default = req.max_completion_tokens, self.default_chat_max_tokens
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            given = req.max_tokens if given is None else given
        else:
            assert isinstance(req, CompletionRequest)
            prompt, prompt_param = self._prompt(req.prompt), "prompt"
            given, default, param = req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens"
        default = default if self.defaults.max_tokens is None else self.defaults.max_tokens
        max_tokens = self._max_tokens(len(prompt), given, default, param, prompt_param)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return CheckedRequest(
            tuple(prompt),
            max_tokens,
            temperature,
            top_p,
            req.seed,
            stops,
            stop_token_ids,
            req.ignore_eos,
            bool(req.stream),
            include_usage,
            req.return_token_ids,
        )

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.limits.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary 0..{self.limits.vocab_size - 1}", param)

    def _prompt(self, given: str | list[int | str | list[int]]) -> list[int]:
        prompt: str | Sequence[int | str | list[int]] = given
        if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str | list):
            prompt = given[0]  # NOTE: a batch of one prompt is that prompt
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt must not be empty", "prompt")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise InvalidArgument("prompt must not be empty", "prompt")
        if not all(isinstance(t, int) for t in prompt):
            kinds = {type(t).__name__ for t in prompt}
            if kinds <= {"str", "list"}:
                raise InvalidArgument(
                    f"batched prompts ({len(prompt)} in one request) are not supported: send one request per prompt",
                    "prompt",
                )
            raise InvalidArgument("prompt must be a string, a list of token ids, or a list of one of them", "prompt")
        ids = [t for t in prompt if isinstance(t, int)]
        self._check_ids(ids, "prompt")
        return ids

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        if not messages:
            raise InvalidArgument("messages must not be empty", "messages")
        turns = [_turn(m, i) for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        except InvalidArgument as exc:  # NOTE: the template's raise_exception (e.g. roles out of order)
            raise InvalidArgument(str(exc), "messages") from exc
        return self.tokenizer.encode(text, add_bos=False)  # NOTE: templates write their own BOS

    def _max_tokens(self, prompt_tokens: int, given: int | None, default: int, param: str, prompt_param: str) -> int:
        context = self.limits.max_context_tokens
        room = min(context - prompt_tokens, MAX_TOKENS_LIMIT)
        if room < 1:
            raise InvalidArgument(
                f"the prompt ({prompt_tokens} tokens) leaves no room for output in the model's "
                f"context of {context} tokens",
                prompt_param,
            )
        if given is None:
            return min(default, room)
        if given < 1:
            raise InvalidArgument(f"{param} must be >= 1, got {given}", param)
        if prompt_tokens + given > context:
            raise InvalidArgument(
                f"this model's context is {context} tokens; the prompt ({prompt_tokens} tokens) "
                f"and {param} ({given}) ask for {prompt_tokens + given}",
                param,
            )
        if given > MAX_TOKENS_LIMIT:  # NOTE: the engine's own bound, below the context of large models
            raise InvalidArgument(f"{param} must be at most {MAX_TOKENS_LIMIT}, got {given}", param)
        return given


def decode_body(raw: bytes, chat: bool) -> ChatRequest | CompletionRequest:
    """The body as its struct (types only). Raises InvalidArgument, naming the parameter whose
    type is wrong (msgspec's path, e.g. "messages[0].role"), without msgspec's own path text."""
    try:
        if chat:
            return msgspec.json.decode(raw, type=ChatRequest)
        return msgspec.json.decode(raw, type=CompletionRequest)
    except msgspec.ValidationError as exc:
        detail, param = _split_path(str(exc))
        if param is None:
            raise InvalidArgument(f"invalid request body: {detail}") from exc
        raise InvalidArgument(f"invalid value for '{param}': {detail}", param) from exc
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:  # NOTE: msgspec raises
        # UnicodeDecodeError itself for a string that is not UTF-8 (found by tests/fuzz: a 500)
        raise InvalidArgument(f"invalid request body (not JSON in UTF-8): {exc}") from exc


_PATH = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")


def _split_path(message: str) -> tuple[str, str | None]:
    """msgspec's "Expected `int`, got `str` - at `$.messages[0].role`" -> (the message, the
    parameter "messages[0].role"); a missing field is the parameter. Pure."""
    match = _PATH.match(message)
    assert match is not None  # NOTE: the pattern matches any string
    # NOTE: msgspec writes a map's value as "[...]": the map is the parameter
    detail, path = match["detail"], (match["path"] or "").removeprefix(".").split("[...]")[0]
    missing = _MISSING.match(detail)
    if missing is not None:
        path = f"{path}.{missing['field']}" if path else missing["field"]
    return detail, path or None


def _check_unsupported(req: Params) -> None:
    for name, off in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if not off(value):
            raise InvalidArgument(f"'{name}' is not supported by this server (got {value!r})", name)


def _check_sampling(req: Params, defaults: GenerationDefaults) -> tuple[float, float]:
    """(temperature, top_p): the request's, else the model's defaults. Raises InvalidArgument."""
    if req.n is not None and req.n != 1:
        raise InvalidArgument(f"n must be 1 (one choice per request), got {req.n}", "n")
    temperature = defaults.temperature if req.temperature is None else req.temperature
    if not (temperature == 0 or MIN_SAMPLING_VALUE <= temperature <= MAX_TEMPERATURE):
        raise InvalidArgument(
            f"temperature must be 0 or in [{MIN_SAMPLING_VALUE}, 2], got {temperature}", "temperature"
        )
    top_p = defaults.top_p if req.top_p is None else req.top_p
    if not MIN_SAMPLING_VALUE <= top_p <= 1:
        raise InvalidArgument(f"top_p must be in [{MIN_SAMPLING_VALUE}, 1], got {top_p}", "top_p")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise InvalidArgument(f"seed must be in 0..2**63-1, got {req.seed}", "seed")
    return temperature, top_p


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise InvalidArgument(f"at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidArgument(f"stop strings must hold 1..{MAX_STOP_CHARS} characters", "stop")
    return stops


def _turn(message: ChatMessage, i: int) -> dict[str, str]:
    """messages[i] as the chat template takes it: its role and text (text parts joined).
    Raises InvalidArgument naming the field at fault."""
    if message.role not in CHAT_ROLES:
        roles = ", ".join(sorted(CHAT_ROLES))
        raise InvalidArgument(f"role {message.role!r} is not supported (only {roles})", f"messages[{i}].role")
    if message.tool_calls:
        raise InvalidArgument("tool calls are not supported", f"messages[{i}].tool_calls")
    if message.content is None and message.role != "assistant":
        raise InvalidArgument(f"a {message.role} message needs content", f"messages[{i}].content")
    return {"role": CHAT_ROLES[message.role], "content": _text(message.content, i)}


def _text(content: str | list[ContentPart] | None, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise InvalidArgument(
                f"content part type {part.type!r} is not supported (only text)", f"messages[{i}].content[{j}].type"
            )
        if part.text is None:
            raise InvalidArgument("a text content part needs text", f"messages[{i}].content[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def model_context_tokens(spec: str) -> int:
    """The context length (tokens) of the model a spec names (see weights.load_model), from its
    config alone: the router never loads the weights.

    Raises:
        ConfigError: an unknown spec, or a config without a usable context length.
    """
    if spec == "tiny" or spec.startswith("tiny:"):
        return TINY_CONFIG.max_position
    path = default_gguf_path() if spec == "smollm2" else Path(spec)
    if path.suffix == ".gguf":
        field = open_gguf(path).get_field("llama.context_length")
        value = None if field is None else field.contents()
    elif (path / "config.json").is_file():
        value = json.loads((path / "config.json").read_text()).get("max_position_embeddings", 2048)
    else:
        raise ConfigError(f"model spec {spec!r}: no context length to read (not tiny, a .gguf or a HF directory)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"model spec {spec!r}: the context length {value!r} is not a positive integer")
    return value
