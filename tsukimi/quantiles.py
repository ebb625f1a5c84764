"""THE quantile definition of the package: nearest rank. Every percentile tsukimi reports (the
benchmarks, the simulator's reports, the dashboard, the decode-stage window) is this one.

    ordered = sorted(values)            n = len(ordered)
    quantile(values, q) = ordered[ceil(q * n) - 1]        0 < q <= 1

So the value returned is always one of the values (never an interpolation), p50 of an even
count is the lower of the two middle values, and at n = 100 p99 is the 99th value (not the
maximum, which is p100). With no values the quantile is NaN (`summary`: None, for JSON).
NaN values are left out first: a request that measured nothing does not count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from tsukimi.errors import ConfigError

DEFAULT_QS = (0.5, 0.9, 0.99)


def rank_index(n: int, q: float) -> int:
    """The index in a sorted sequence of `n` values that holds its `q` quantile (pure).

    Raises:
        ConfigError: q outside (0, 1], or n < 1.
    """
    if not 0 < q <= 1:
        raise ConfigError(f"a quantile is in (0, 1], got {q}")
    if n < 1:
        raise ConfigError("the quantile of no values has no index")
    # NOTE: round away float noise first (0.29 * 100 = 28.999999999999996), then the ceiling
    return min(n, max(1, math.ceil(round(q * n, 9)))) - 1


def quantile_of_sorted(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile of values already sorted ascending (NaN when empty; pure, O(1)).

    Raises:
        ConfigError: q outside (0, 1].
    """
    if not ordered:
        if not 0 < q <= 1:
            raise ConfigError(f"a quantile is in (0, 1], got {q}")
        return math.nan
    return ordered[rank_index(len(ordered), q)]


def quantiles(values: Iterable[float], qs: Sequence[float] = DEFAULT_QS) -> list[float]:
    """Each of the `qs` quantiles of `values` (NaN values left out; NaN each when none are
    left), sorting once (pure).

    Raises:
        ConfigError: a q outside (0, 1].
    """
    ordered = sorted(v for v in values if v == v)
    return [quantile_of_sorted(ordered, q) for q in qs]


def quantile(values: Iterable[float], q: float) -> float:
    """The `q` quantile of `values` (see the module; NaN when there are none). Pure.

    Raises:
        ConfigError: q outside (0, 1].
    """
    return quantiles(values, (q,))[0]


def label(q: float) -> str:
    """The key a quantile goes by in a report: 0.5 -> "p50", 0.999 -> "p99.9" (pure)."""
    return f"p{round(q * 100, 6):g}"


def summary(
    values: Iterable[float], qs: Sequence[float] = DEFAULT_QS, ndigits: int | None = None
) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "p99": ...} of `values` for a report: None where there is no
    value (JSON null), each rounded to `ndigits` when given. Pure.

    Raises:
        ConfigError: a q outside (0, 1].
    """
    out: dict[str, float | None] = {}
    for q, value in zip(qs, quantiles(values, qs), strict=True):
        out[label(q)] = None if value != value else value if ndigits is None else round(value, ndigits)
    return out
