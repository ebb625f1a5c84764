"""THE quantile definition (tsukimi/quantiles.py): nearest rank, exactly, and its edges."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tsukimi.errors import ConfigError
from tsukimi.quantiles import label, quantile, quantile_of_sorted, quantiles, rank_index, summary

HUNDRED = [float(x) for x in range(100, 0, -1)]  # 1..100, shuffled by reversal


def test_at_n_100_p99_is_the_99th_value_not_the_maximum() -> None:
    assert quantiles(HUNDRED, (0.5, 0.9, 0.99, 1.0)) == [50.0, 90.0, 99.0, 100.0]


def test_p50_of_an_even_count_is_the_lower_middle_value() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0], 0.5) == 2.0


def test_small_counts_exactly() -> None:
    assert quantiles([7.0], (0.01, 0.5, 1.0)) == [7.0, 7.0, 7.0]
    ten = [float(x) for x in range(1, 11)]
    assert quantiles(ten, (0.1, 0.15, 0.9, 0.91, 0.99)) == [1.0, 2.0, 9.0, 10.0, 10.0]


def test_float_noise_does_not_move_the_rank() -> None:
    # NOTE: 0.9 * 70 = 63.00000000000001 in floats; the 63rd value, not the 64th
    assert rank_index(70, 0.9) == 62 and rank_index(100, 0.07) == 6 and rank_index(100, 0.29) == 28


def test_no_values_is_nan_and_null_in_a_summary() -> None:
    assert math.isnan(quantile([], 0.5))
    assert math.isnan(quantile([math.nan], 0.5))
    assert summary([]) == {"p50": None, "p90": None, "p99": None}


def test_nan_values_are_left_out() -> None:
    assert quantiles([math.nan, 3.0, 1.0, math.nan, 2.0], (0.5, 1.0)) == [2.0, 3.0]


def test_summary_labels_and_rounds() -> None:
    assert summary([0.123456, 0.2], (0.5, 0.999), ndigits=3) == {"p50": 0.123, "p99.9": 0.2}
    assert (label(0.5), label(0.9), label(0.99), label(0.999), label(1.0)) == ("p50", "p90", "p99", "p99.9", "p100")


@pytest.mark.parametrize("q", [0.0, -0.5, 1.5])
def test_a_quantile_outside_0_1_is_a_config_error(q: float) -> None:
    with pytest.raises(ConfigError, match="in \\(0, 1\\]"):
        quantile([1.0], q)
    with pytest.raises(ConfigError):
        quantile_of_sorted([], q)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1), st.floats(0.001, 1.0))
def test_the_definition_holds_for_any_values(values: list[float], q: float) -> None:
    ordered = sorted(values)
    value = quantile(values, q)
    at_or_below = sum(v <= value for v in ordered)
    below = sum(v < value for v in ordered)
    # nearest rank: the smallest value with at least q * n values at or below it
    assert value in values
    assert at_or_below >= q * len(values) - 1e-9
    assert below < q * len(values) + 1e-9
    assert value == ordered[math.ceil(round(q * len(values), 9)) - 1]


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1))
def test_quantiles_rise_with_q(values: list[float]) -> None:
    qs = (0.01, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
    got = quantiles(values, qs)
    assert got == sorted(got) and got[-1] == max(values)
