"""Devices and dtypes a worker may ask for, the random model presets, and in-process prefill
timing, on the CPU (the CUDA side: tests/engine/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from tsukimi.config import WorkerConfig
from tsukimi.engine.device import resolve_device, resolve_dtype
from tsukimi.engine.prefill_timing import time_prefill
from tsukimi.engine.presets import preset_config, random_preset
from tsukimi.engine.weights import load_model
from tsukimi.errors import ConfigError, InvalidArgument
from tsukimi.serving.worker.commands import worker_args

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


@no_cuda
def test_cuda_without_a_gpu_is_a_config_error_naming_the_way_out() -> None:
    with pytest.raises(ConfigError, match=r"device 'cuda' was asked for but torch .* sees no CUDA GPU.*--device cpu"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"  # today's CPU engine, unchanged
    assert resolve_dtype("auto", torch.device("cuda")) == "bfloat16"


def test_bad_devices_and_dtypes_name_the_choices() -> None:
    with pytest.raises(ConfigError, match="device must be one of auto, cpu, cuda"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="worker device must be one of auto, cpu, cuda or cuda:N"):
        WorkerConfig(device="gpu")
    with pytest.raises(ConfigError, match="worker dtype must be one of auto, float32, bfloat16, float16"):
        WorkerConfig(dtype="float64")  # type: ignore[arg-type]
    config = WorkerConfig(device="cuda:1", dtype="float16")
    args = worker_args(config)
    assert args[args.index("--device") + 1] == "cuda:1" and args[args.index("--dtype") + 1] == "float16"


def test_the_llama3_8b_preset_has_llama3_8b_s_shape() -> None:
    config = preset_config("llama3-8b", 3, "bfloat16", torch.device("cuda"))
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (32, 4096, 32, 8, 128)
    assert (config.intermediate_size, config.vocab_size, config.rope_theta) == (14336, 128256, 500000.0)
    assert config.kv_bytes_per_token == 128 << 10  # 128 KiB per token in bfloat16 (GPU.md)
    assert config.source == "random:llama3-8b:seed=3:cuda"  # KV of CPU and GPU draws never mixes
    with pytest.raises(ConfigError, match="unknown model preset 'llama4'"):
        preset_config("llama4", 0, "float32", torch.device("cpu"))


def test_a_scaled_down_llama3_builds_seeded_on_the_cpu() -> None:
    a = random_preset("llama3-8b", 1, "bfloat16", "cpu", num_layers=1, hidden_size=256, intermediate_size=512)
    b = random_preset("llama3-8b", 1, "bfloat16", "cpu", num_layers=1, hidden_size=256, intermediate_size=512)
    config, model = a
    assert config.num_layers == 1 and config.source.endswith(":hidden_size=256:intermediate_size=512:num_layers=1")
    params = dict(model.named_parameters())
    assert params["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert params["layers.0.self_attn.k_proj.weight"].shape == (8 * 128, 256)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), b[1].parameters(), strict=True))


def test_the_smollm2_preset_loads_by_name() -> None:
    loaded = load_model("random:smollm2-135m:7")
    assert loaded.config.num_layers == 30 and loaded.config.tie_word_embeddings
    assert loaded.source == "random:smollm2-135m:seed=7:cpu"
    assert 1.3e8 < sum(p.numel() for p in loaded.model.parameters()) < 1.4e8
    with pytest.raises(ConfigError, match="seed must be a non-negative integer"):
        load_model("random:smollm2-135m:x")


def test_time_prefill_reuses_the_prefix_on_the_cpu() -> None:
    timing = time_prefill("tiny", 96, device="cpu", prefix_tokens=70)
    assert timing.prefix_tokens == 64  # whole blocks of 16
    assert timing.prefill_s > 0 and timing.load_s is not None and timing.reuse_s is not None
    assert time_prefill("tiny", 32, device="cpu").reuse_s is None
    with pytest.raises(InvalidArgument, match="prefix_tokens"):
        time_prefill("tiny", 32, device="cpu", prefix_tokens=32)
