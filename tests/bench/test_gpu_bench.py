"""`tsukimi bench gpu`'s parts: the raw model's shape and parameters (the Llama-3-8B count, the
prefill / reuse equivalence at a tiny size), the configuration per device, the verdicts (never
met or failed without CUDA), and, marked `gpu`, the same model and copies on a CUDA device with
the flash kernel forced (skipped here; `make gpu-check` runs them on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from tsukimi.bench.gpu import GpuBenchConfig, token_label, verdicts
from tsukimi.bench.gpu_copies import NO_CUDA, copy_rows, kv_block_rows, size_label
from tsukimi.bench.gpu_model import SHAPES, RawDecoder, RawShape
from tsukimi.errors import ConfigError


def test_llama3_8b_shape_counts_its_parameters_and_kv() -> None:
    shape = SHAPES["llama3-8b"]
    assert shape.num_params == 8_030_261_248  # Meta-Llama-3-8B's published count
    assert shape.kv_bytes_per_token(torch.bfloat16) == 128 << 10


def test_tiny_model_has_the_parameters_its_shape_counts() -> None:
    shape = SHAPES["tiny"]
    model = RawDecoder(shape, "cpu", torch.float32)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
    logits, kv = model(torch.arange(10), keep_kv=True)
    assert logits.shape == (shape.vocab,)
    assert len(kv) == shape.num_layers
    assert all(k.shape == v.shape == (10, shape.num_kv_heads, shape.head_dim) for k, v in kv)


def test_reuse_of_a_prefix_gives_the_prefill_logits() -> None:
    torch.manual_seed(0)
    model = RawDecoder(SHAPES["tiny"], "cpu", torch.float32)
    tokens = torch.randint(0, 256, (40,))
    whole, _ = model(tokens)
    _, prefix = model(tokens[:32], keep_kv=True)
    reused, _ = model(tokens[32:], past=prefix)  # NOTE: wrong if the mask were aligned top-left
    torch.testing.assert_close(reused, whole, rtol=1e-4, atol=1e-5)


def test_shapes_and_config_are_validated() -> None:
    with pytest.raises(ConfigError, match="multiple of KV heads"):
        RawShape("bad", 1, 8, 3, 2, 4, 8, 8)
    with pytest.raises(ConfigError, match="llama3-8b"):
        GpuBenchConfig.for_device(cuda=False, quick=True, shape="llama4")


def test_sizes_follow_the_device() -> None:
    gpu = GpuBenchConfig.for_device(cuda=True, quick=False)
    assert (gpu.shape, gpu.prompt_tokens, gpu.new_tokens) == ("llama3-8b", (4096, 16384, 32768), 512)
    assert [size_label(n) for n in gpu.copy_bytes] == ["64KiB", "1MiB", "64MiB", "1GiB"]
    quick = GpuBenchConfig.for_device(cuda=True, quick=True)
    assert [token_label(n) for n in quick.prompt_tokens] == ["4k", "16k"] and (1 << 30) not in quick.copy_bytes
    assert GpuBenchConfig.for_device(cuda=False, quick=True).shape == "tiny"


def test_verdicts_read_tsukimi_rows_against_raw_ones_and_never_judge_without_cuda() -> None:
    figures = {
        "raw.h2d_pinned_gbps.1MiB": 40.0,
        "raw.h2d_pinned_gbps.64MiB": 50.0,
        "tsukimi.te_h2d_gbps.1MiB": 36.0,
        "tsukimi.te_h2d_gbps.64MiB": 30.0,
        "tsukimi.store_kv_blocks_gbps": 31.0,
        "raw.prefill_s.16k": 0.5,
        "tsukimi.engine_prefill_s.16k": 1.0,
    }
    on_gpu = {v.name: v for v in verdicts(figures, cuda=True)}
    assert on_gpu["te_h2d_vs_pinned"].met is False and on_gpu["te_h2d_vs_pinned"].detail == "0.6"
    assert on_gpu["store_kv_blocks_gbps"].met is True
    assert on_gpu["engine_prefill_vs_raw_16k"].met is False  # 0.5x the raw tokens/s
    assert on_gpu["engine_reuse_vs_recompute_16k"].met is None  # no reuse row
    assert all(v.met is None and v.detail == NO_CUDA for v in verdicts(figures, cuda=False))


def test_without_cuda_gpu_rows_say_so() -> None:
    rows = copy_rows((64 << 10,), cuda=False, repeats=1) | kv_block_rows(16, 1024, cuda=False, repeats=1)
    assert rows["raw.h2d_pinned_gbps.64KiB"] == rows["raw.kv_h2d_batched_gbps"] == NO_CUDA
    assert isinstance(rows["raw.memcpy_gbps.64KiB"], float) and isinstance(rows["raw.kv_host_batched_gbps"], float)


@pytest.mark.gpu
def test_raw_model_runs_the_flash_kernel_on_cuda() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shape = RawShape("small", 2, 512, 8, 2, 64, 1024, 1000)
    model = RawDecoder(shape, "cuda", torch.bfloat16)
    tokens = torch.randint(0, shape.vocab, (300,), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # NOTE: raises rather than falling back to math
        whole, _ = model(tokens)
        _, prefix = model(tokens[:256], keep_kv=True)
        reused, _ = model(tokens[256:], past=prefix)
    assert whole.device.type == "cuda" and whole.dtype == torch.bfloat16
    torch.testing.assert_close(reused.float(), whole.float(), rtol=0.05, atol=0.05)


@pytest.mark.gpu
def test_copy_rows_measure_on_cuda_and_blocks_land_in_place() -> None:
    rows = copy_rows((1 << 20,), cuda=True, repeats=1) | kv_block_rows(256, 32 << 10, cuda=True, repeats=1)
    for key in ("raw.h2d_pinned_gbps.1MiB", "raw.d2h_pageable_gbps.1MiB", "raw.kv_h2d_per_block_gbps"):
        assert isinstance(rows[key], float) and rows[key] > 0, key
