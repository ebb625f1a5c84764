"""The decode-stage survival model behind prediction-based early rejection."""

from __future__ import annotations

import pytest

from tsukimi.errors import ConfigError
from tsukimi.scheduler.load_prediction import DecodeLoad, DecodeStagePredictor, SlidingWindow, uniform_load


def test_prior_until_anything_is_observed() -> None:
    predictor = DecodeStagePredictor(prior_s=10.0)
    assert predictor.survival(9.9) == 1.0 and predictor.survival(10.0) == 0.0
    assert predictor.still_present(5.0, 2.0) == 1.0 and predictor.still_present(5.0, 6.0) == 0.0


def test_regression_survival_is_exact_inside_a_second() -> None:
    predictor = DecodeStagePredictor(prior_s=10.0)
    for i in range(100):
        predictor.observe(5.0 + i / 100)  # 5.00 .. 5.99
    assert predictor.survival(5.1) == pytest.approx(0.89)
    assert predictor.survival(4.0) == 1.0 and predictor.survival(6.0) == 0.0
    assert predictor.still_present(5.2, 0.3) == pytest.approx(49 / 79)  # P(> 5.5 | > 5.2)
    assert predictor.still_present(7.0, 1.0) == 1.0  # outlived every observation: assumed to stay


def test_window_forgets_old_observations() -> None:
    predictor = DecodeStagePredictor(prior_s=1.0, window=3)
    for duration in (100.0, 1.0, 2.0, 3.0):
        predictor.observe(duration)
    assert predictor.observed == 3 and predictor.survival(50.0) == 0.0
    with pytest.raises(ConfigError):
        DecodeStagePredictor(prior_s=0.0)


def test_sliding_window_mean_and_quantiles() -> None:
    window = SlidingWindow(4)
    for value in (5.0, 1.0, 3.0, 2.0, 4.0):  # 5.0 is forgotten
        window.observe(value)
    assert len(window) == 4 and window.mean() == 2.5
    assert (window.quantile(0.5), window.quantile(0.9), window.count_above(2.0)) == (2.0, 4.0, 2)


def test_uniform_load_counts_requests_that_reached_decode_within_one_stage() -> None:
    load = DecodeLoad(10_000, active={1: (0.0, 100), 2: (8.0, 200)}, incoming={3: (11.0, 300), 4: (13.0, 400)})
    # at 12 s with 5 s stages: request 1 (joined 0 s) is gone, 2 and 3 are there, 4 not yet
    assert uniform_load(load, 12.0, 5.0) == (2.0, 500.0)
