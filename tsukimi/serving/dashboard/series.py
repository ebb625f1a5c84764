"""Latency over time for the dashboard: the recent TTFT and TBT samples the router observes,
and a ring of per-interval points built from them.

    request path:  ApiMetrics.ttft.observe(x) -> Prometheus histogram + SampledHistogram.recent (a deque append)
    sampler tick:  Series.add(wall_s, ttft samples, tbt samples, counters) -> Point (percentiles, rates)

`SampledHistogram` is a Prometheus `Histogram` that also keeps its newest raw samples in a
bounded deque (`recent`), which the dashboard's sampler drains once per interval: the request
path pays one append, percentiles are computed off it, at most once per interval.

Runs on the router's event loop (no locks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import msgspec
from prometheus_client import Histogram

from tsukimi.quantiles import quantiles

MAX_SAMPLES = 2048  # per histogram between two sampler ticks; older ones are dropped (bounds a tick's sort)
DEFAULT_POINTS = 600  # ten minutes at one point a second
QUANTILES = (0.5, 0.9, 0.99)


class SampledHistogram(Histogram):
    """A Prometheus histogram whose newest observations are also kept raw in `recent`
    (bounded; drained by `take`). Unlabelled use only."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.recent: deque[float] = deque(maxlen=MAX_SAMPLES)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        super().observe(amount, exemplar)
        self.recent.append(amount)

    def take(self) -> list[float]:
        """The samples observed since the last call, oldest first (mutates: empties `recent`)."""
        out = list(self.recent)
        self.recent.clear()
        return out


class Point(msgspec.Struct, frozen=True, array_like=True):
    """One interval on the charts (a JSON array): its end (`wall_s`, Unix seconds), TTFT and
    TBT percentiles in seconds (p50, p90, p99; NaN-free: null when the interval had none), the
    requests finished and tokens generated per second."""

    wall_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tbt_p50_s: float | None
    tbt_p90_s: float | None
    tbt_p99_s: float | None
    requests_per_s: float
    tokens_per_s: float


def percentiles(samples: Sequence[float], qs: Sequence[float] = QUANTILES) -> list[float | None]:
    """The `qs` quantiles of `samples` (tsukimi/quantiles.py: nearest rank; None each when
    there are none). Pure."""
    return [None if value != value else value for value in quantiles(samples, qs)]


class Series:
    """The newest `capacity` points and the raw samples behind the newest `window` of them
    (for percentiles over a window). Mutable; fed by the sampler only."""

    def __init__(self, capacity: int = DEFAULT_POINTS, window: int = 60) -> None:
        self.points: deque[Point] = deque(maxlen=capacity)
        self.window_intervals = window
        self._ttft: deque[list[float]] = deque(maxlen=window)
        self._tbt: deque[list[float]] = deque(maxlen=window)
        self._last: tuple[float, float, float] | None = None  # wall_s, requests, tokens at the last point

    def add(self, wall_s: float, ttft: list[float], tbt: list[float], requests: float, tokens: float) -> Point:
        """Appends the point of the interval ending at `wall_s`; `requests` / `tokens` are the
        running totals (their rates are the change since the last point). Mutates."""
        self._ttft.append(ttft)
        self._tbt.append(tbt)
        rps = tps = 0.0
        if self._last is not None and wall_s > self._last[0]:
            span = wall_s - self._last[0]
            rps, tps = max(0.0, requests - self._last[1]) / span, max(0.0, tokens - self._last[2]) / span
        self._last = (wall_s, requests, tokens)
        (t50, t90, t99), (b50, b90, b99) = percentiles(ttft), percentiles(tbt)
        point = Point(wall_s, t50, t90, t99, b50, b90, b99, rps, tps)
        self.points.append(point)
        return point

    def window(self) -> tuple[list[float | None], list[float | None], int]:
        """TTFT and TBT percentiles over the window, and how many TTFT samples it holds (pure)."""
        ttft = [x for chunk in self._ttft for x in chunk]
        return percentiles(ttft), percentiles([x for chunk in self._tbt for x in chunk]), len(ttft)
