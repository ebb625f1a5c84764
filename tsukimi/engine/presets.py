"""Model presets with seeded random weights, for benchmarks at real shapes without a download.

    random:llama3-8b[:SEED]      Llama-3-8B's shape: 32 layers, hidden 4096, 32/8 GQA heads of 128,
                                 intermediate 14336, vocab 128256, RoPE theta 500000 (~8.0e9 parameters)
    random:smollm2-135m[:SEED]   SmolLM2-135M's shape: 30 layers, hidden 576, 9/3 heads of 64,
                                 intermediate 1536, vocab 49152, tied embeddings

The weights are drawn straight on the target device in the target dtype (an 8B model in
bfloat16 on a GPU takes seconds and never exists in float32 or in host memory), from a
generator seeded on that device: the same seed gives the same weights on every machine of the
same device type, and `ModelConfig.source` names the preset, the seed and the device type so
that KV computed on a CPU and on a GPU (different draws) is never exchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, cast

import torch

from tsukimi.config import DTypeName
from tsukimi.engine.model import LlamaModel, ModelConfig
from tsukimi.errors import ConfigError

logger = logging.getLogger(__name__)

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        name="random-llama3-8b",
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "smollm2-135m": ModelConfig(
        name="random-smollm2-135m",
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position=32768,  # NOTE: 8192 in the real model; random weights serve the benchmarks' 32k prompts
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


def preset_config(name: str, seed: int, dtype: DTypeName, device: torch.device, **overrides: int) -> ModelConfig:
    """The config of preset `name` (pure).

    Args:
        name / seed / dtype / device: the preset, its weights' seed, dtype and device type.
        overrides: integer shape fields to change (e.g. num_layers=2, for a scaled-down test).

    Raises:
        ConfigError: an unknown preset or field.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}: one of {', '.join(PRESETS)}")
    unknown = overrides.keys() - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"model preset {name}: unknown ModelConfig fields {sorted(unknown)}")
    source = f"random:{name}:seed={seed}:{device.type}" + "".join(f":{k}={v}" for k, v in sorted(overrides.items()))
    shape = cast("dict[str, Any]", overrides)
    return dataclasses.replace(PRESETS[name], dtype=dtype, source=source, **shape)


@torch.inference_mode()
def random_preset(
    name: str, seed: int = 0, dtype: DTypeName = "float32", device: torch.device | str = "cpu", **overrides: int
) -> tuple[ModelConfig, LlamaModel]:
    """Build preset `name` with seeded random weights on `device` (see the module).

    Embeddings are N(0, 1), projections N(0, 1/fan_in) (activations keep their scale across
    the layers), norms 1. Draws from its own generator, not the global RNG.

    Returns:
        The config and the model (eval mode, no grad), its parameters on `device`.

    Raises:
        ConfigError: as `preset_config`.
    """
    device = torch.device(device)
    config = preset_config(name, seed, dtype, device, **overrides)
    start = time.perf_counter()
    with torch.device(device):  # NOTE: the parameters are allocated there, never on the host first
        model = LlamaModel(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for param_name, param in model.named_parameters():
        if param_name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            std = 1.0 if param_name == "embed_tokens.weight" else 1.0 / math.sqrt(param.shape[1])
            param.normal_(0.0, std, generator=generator)
    logger.info("built %s (%s, %s) in %.2f s", config.name, dtype, device, time.perf_counter() - start)
    return config, model.eval()
