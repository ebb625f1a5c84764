"""The cost models: the roofline default's numbers, and fitting from profiles."""

from __future__ import annotations

import pytest

from tsukimi.errors import ConfigError, InvalidArgument
from tsukimi.scheduler.cost_model import (
    A800_X8,
    LLAMA2_70B,
    DecodeSample,
    LinearCostModel,
    NodeSpec,
    PrefillSample,
    RooflineCostModel,
    attention_pairs,
    chunked_prefill_s,
    fit_linear,
)


def test_roofline_default_is_the_papers_setup() -> None:
    model = RooflineCostModel()
    assert LLAMA2_70B.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB per token
    flops_s = 8 * 312e12 * 0.5
    expected = (2 * 69e9 * 8192 + 4 * 80 * 8192 * attention_pairs(8192, 0)) / flops_s + 0.005
    assert model.prefill_s(8192) == pytest.approx(expected)  # compute-bound: about 1 s
    weights_s = 69e9 * 2 / (8 * 2.039e12 * 0.7)
    assert model.decode_step_s(1, 0) == pytest.approx(weights_s + 0.005, rel=1e-3)  # memory-bound: ~17 ms
    assert model.decode_step_s(1, 100_000) == pytest.approx(
        (69e9 * 2 + 100_000 * 327_680) / (8 * 2.039e12 * 0.7) + 0.005, rel=1e-3
    )
    assert 1_000_000 < model.kv_capacity_tokens() < 2_000_000
    assert model.transfer_s(1000, 100e9) == pytest.approx(1000 * 327_680 / 100e9)


def test_roofline_is_monotone_where_it_should_be() -> None:
    model = RooflineCostModel()
    assert model.prefill_s(4096, 8192) < model.prefill_s(12288, 0)  # a cache hit saves work
    assert model.prefill_s(4096, 8192) > model.prefill_s(4096, 0)  # but attending to it costs
    assert model.decode_step_s(64, 500_000) > model.decode_step_s(64, 100_000) > model.decode_step_s(1, 0)
    assert model.prefill_s(0) == 0.0 and model.decode_step_s(0, 0) == 0.0
    assert chunked_prefill_s(model, 8192, 0, 2048) > model.prefill_s(8192)  # each chunk pays overhead
    mixed = model.mixed_step_s(512, 0, 32, 200_000)
    assert max(model.prefill_s(512), model.decode_step_s(32, 200_000)) <= mixed
    with pytest.raises(ConfigError):
        NodeSpec("bad", 1, 1e12, 1e12, 1e9, mfu=0.0)
    assert A800_X8.gpus == 8


def test_fitting_recovers_a_linear_model() -> None:
    truth = LinearCostModel((0.002, 5e-5, 3e-9), (0.008, 2e-4, 4e-8), kv_bytes_per_token=4096)
    prefill = [PrefillSample(n, c, truth.prefill_s(n, c)) for n in (64, 256, 1024, 4096) for c in (0, 2048)]
    decode = [DecodeSample(b, t, truth.decode_step_s(b, t)) for b in (1, 8, 32) for t in (1000, 50_000)]
    fitted = fit_linear(prefill, decode, 4096)
    assert fitted.prefill_coef == pytest.approx(truth.prefill_coef, rel=1e-6)
    assert fitted.decode_coef == pytest.approx(truth.decode_coef, rel=1e-6)


def test_fitting_keeps_coefficients_non_negative_and_validates() -> None:
    # time falls with batch size here: a negative batch coefficient is dropped and the rest refitted
    decode = [DecodeSample(b, 1000, 0.02 - 0.0001 * b) for b in (1, 2, 4, 8)]
    prefill = [PrefillSample(n, 0, 0.001 * n) for n in (10, 20, 40)]
    fitted = fit_linear(prefill, decode, 1)
    assert min(fitted.decode_coef) >= 0 and min(fitted.prefill_coef) >= 0
    assert fitted.prefill_s(100) == pytest.approx(0.1, rel=1e-6)
    with pytest.raises(InvalidArgument):
        fit_linear(prefill[:2], decode, 1)
    with pytest.raises(InvalidArgument):
        fit_linear([*prefill, PrefillSample(1, 0, float("nan"))], decode, 1)
