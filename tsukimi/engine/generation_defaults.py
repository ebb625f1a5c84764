"""A served model's generation defaults: the sampling values a request that sets none runs at.

This module owns where they come from, per model spec (see weights.load_model), read from the
model's files alone (the router never loads the weights):

    spec                        defaults                                       source
    tiny, tiny:SEED, random:*   temperature 1, top_p 1 (OpenAI's)              "openai"
    HF_DIRECTORY                generation_config.json's temperature, top_p    "generation_config.json"
                                and max_new_tokens where it has any of them
    smollm2, PATH.gguf          the GGUF's general.sampling.temp / top_p       "gguf"
    (a real model stating none) greedy: temperature 0, top_p 1                 "greedy"

As vLLM's `--generation-config auto` does, a model that states some of the keys gets OpenAI's
value for the others, and `do_sample` is not read. A random model keeps OpenAI's defaults: it
has no answer worth being greedy for, and its tests sample. A real model that states none
(SmolLM2-135M-Instruct's generation_config.json and GGUF carry no sampling keys) runs greedy:
measured on the shipped 4-bit SmolLM2 with README's question ("What is the capital of
France?"), greedy named Paris for every seed, the temperature 0.2 / top_p 0.9 of its model
card's example in 3 of 6 seeds, temperature 1 in 1.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from gguf import GGUFReader

from tsukimi.engine.sampling import MAX_TOKENS_LIMIT, MIN_SAMPLING_VALUE
from tsukimi.engine.weights import default_gguf_path, open_gguf
from tsukimi.errors import ConfigError

logger = logging.getLogger(__name__)

DefaultsSource = Literal["openai", "generation_config.json", "gguf", "greedy"]
MAX_DEFAULT_TEMPERATURE = 2.0  # OpenAI's range: what a request could ask for itself
GENERATION_CONFIG: Final = "generation_config.json"
GGUF_TEMPERATURE, GGUF_TOP_P = "general.sampling.temp", "general.sampling.top_p"  # llama.cpp's keys
# NOTE: keys vLLM takes from a generation config that tsukimi cannot sample with: named in a warning
_IGNORED_KEYS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a request that omits them gets: `temperature` (0 = greedy), `top_p`, and
    `max_tokens` (None: the endpoint's own default); `source` says where they come from."""

    temperature: float
    top_p: float
    source: DefaultsSource
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or MIN_SAMPLING_VALUE <= self.temperature <= MAX_DEFAULT_TEMPERATURE):
            raise ConfigError(
                f"the default temperature {self.temperature} is neither 0 nor in "
                f"[{MIN_SAMPLING_VALUE}, {MAX_DEFAULT_TEMPERATURE}]"
            )
        if not MIN_SAMPLING_VALUE <= self.top_p <= 1:
            raise ConfigError(f"the default top_p {self.top_p} is not in [{MIN_SAMPLING_VALUE}, 1]")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ConfigError(f"the default max_new_tokens {self.max_tokens} is not in 1..{MAX_TOKENS_LIMIT}")

    def body(self) -> dict[str, object]:
        """As /v1/models shows them (max_tokens only when the model states one)."""
        shown: dict[str, object] = {"temperature": self.temperature, "top_p": self.top_p, "source": self.source}
        return shown | ({} if self.max_tokens is None else {"max_tokens": self.max_tokens})


OPENAI_DEFAULTS = GenerationDefaults(1.0, 1.0, "openai")
GREEDY_DEFAULTS = GenerationDefaults(0.0, 1.0, "greedy")


def generation_defaults(spec: str) -> GenerationDefaults:
    """The generation defaults of the model a spec names (see the module), from its files alone.

    Raises:
        ConfigError: an unknown spec, an unreadable file, or values out of range.
    """
    if spec == "tiny" or spec.startswith(("tiny:", "random:")):
        return OPENAI_DEFAULTS
    path = default_gguf_path() if spec == "smollm2" else Path(spec)
    if path.suffix == ".gguf":
        return gguf_generation_defaults(open_gguf(path))
    if path.is_dir():
        return hf_generation_defaults(path)
    raise ConfigError(f"model spec {spec!r}: no generation defaults to read (not tiny, random:*, a .gguf or a folder)")


def hf_generation_defaults(folder: Path) -> GenerationDefaults:
    """From a Hugging Face folder's generation_config.json (greedy without the file or its keys).

    Raises:
        ConfigError: the file is not a JSON object, a value is not a number or out of range.
    """
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return GREEDY_DEFAULTS
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds {type(raw).__name__}, expected a JSON object")
    ignored = [k for k in _IGNORED_KEYS if raw.get(k) is not None]
    if ignored:
        logger.warning("%s: %s not applied (tsukimi samples with temperature and top_p only)", path, ignored)
    temperature, top_p = (_checked(raw.get(key), f"{path}: {key}") for key in ("temperature", "top_p"))
    max_new_tokens = raw.get("max_new_tokens")
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)):
        raise ConfigError(f"{path}: max_new_tokens is {max_new_tokens!r}, expected an integer")
    if temperature is None and top_p is None and max_new_tokens is None:
        return GREEDY_DEFAULTS
    return _stated(temperature, top_p, GENERATION_CONFIG, max_new_tokens, str(path))


def gguf_generation_defaults(reader: GGUFReader) -> GenerationDefaults:
    """From a GGUF's general.sampling.temp / top_p metadata (greedy when it has neither).

    Raises:
        ConfigError: a value is not a number or out of range.
    """
    found = {key: reader.get_field(key) for key in (GGUF_TEMPERATURE, GGUF_TOP_P)}
    values = {key: None if field is None else field.contents() for key, field in found.items()}
    numbers = {key: _checked(value, f"GGUF {key}") for key, value in values.items()}
    temperature, top_p = numbers[GGUF_TEMPERATURE], numbers[GGUF_TOP_P]
    if temperature is None and top_p is None:
        return GREEDY_DEFAULTS
    return _stated(temperature, top_p, "gguf", None, "the GGUF's metadata")


def _stated(
    temperature: float | None, top_p: float | None, source: DefaultsSource, max_tokens: int | None, where: str
) -> GenerationDefaults:
    """What a model states, OpenAI's values for what it does not (as vLLM does). Raises
    ConfigError naming `where` for values out of range."""
    try:
        return GenerationDefaults(
            1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p, source, max_tokens
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _checked(value: object, what: str) -> float | None:
    """`value` as a float (None stays None). Raises ConfigError naming `what` for a non-number."""
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{what} is {value!r}, expected a number")
    return float(value)
