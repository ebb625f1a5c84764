"""How long requests stay in decode, learned from the ones that finished: the Conductor's
system-level prediction of decode load (the paper predicts the load of the decode pool
rather than each request's output length, which is unknown at arrival).

The predictor keeps the most recent `window` observed decode-stage durations, sorted, and
answers with their empirical survival function: `survival(t)` = P(a stage lasts longer than
t), and `still_present(age, horizon)` = P(a request in decode for `age` seconds is still there
`horizon` seconds later) = S(age + horizon) / S(age). A request that has outlived every
observation is assumed to stay. Until anything is observed, stages are assumed to last
`prior_s`.

Two forecasts of one decode instance's load at a future time (`DecodeLoad` is the Conductor's
book of it): `expected_load` weights every request by the survival function (ours), and
`uniform_load` is the paper's system-level prediction as written (arXiv v3, Section 7.4):
every decode stage is assumed to last the same `stage_s` (the mean observed), so a request
counts at time t exactly when it reached decode in (t - stage_s, t].
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from tsukimi.errors import ConfigError
from tsukimi.quantiles import quantile_of_sorted


class SlidingWindow:
    """The most recent `size` observations of a quantity, kept sorted: mean, quantiles and
    counts above a value in O(log n); O(size) per observation. Not thread-safe."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ConfigError(f"a window holds at least 1 observation, got {size}")
        self._window: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []
        self._sum = 0.0

    def __len__(self) -> int:
        return len(self._sorted)

    def observe(self, value: float) -> None:
        """Add `value`, forgetting the oldest when full (mutates)."""
        if len(self._window) == self._window.maxlen:
            oldest = self._window[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
            self._sum -= oldest
        self._window.append(value)
        bisect.insort(self._sorted, value)
        self._sum += value

    def mean(self) -> float:
        """The mean (NaN when empty)."""
        return self._sum / len(self._sorted) if self._sorted else math.nan

    def quantile(self, q: float) -> float:
        """The `q` quantile, 0 < q <= 1 (tsukimi/quantiles.py: nearest rank; NaN when empty). O(1)."""
        return quantile_of_sorted(self._sorted, q)

    def count_above(self, value: float) -> int:
        """Observations greater than `value`."""
        return len(self._sorted) - bisect.bisect_right(self._sorted, value)


class DecodeStagePredictor:
    """Not thread-safe; O(log n) queries, O(window) per observation."""

    def __init__(self, prior_s: float, window: int = 4096) -> None:
        if not prior_s > 0 or window < 1:
            raise ConfigError(f"the prior decode stage length must be > 0 and the window >= 1 ({prior_s}, {window})")
        self.prior_s = prior_s  # NOTE: the Conductor may set it per decision until one is observed
        self._stages = SlidingWindow(window)

    @property
    def observed(self) -> int:
        return len(self._stages)

    @property
    def mean_s(self) -> float:
        """The mean observed decode stage (the prior until one is observed)."""
        return self._stages.mean() if len(self._stages) else self.prior_s

    def observe(self, duration_s: float) -> None:
        """A request left decode after `duration_s` seconds (mutates)."""
        self._stages.observe(duration_s)

    def survival(self, t: float) -> float:
        """P(a decode stage lasts longer than `t` seconds)."""
        if t < 0:
            return 1.0
        if not len(self._stages):
            return 1.0 if t < self.prior_s else 0.0
        return self._stages.count_above(t) / len(self._stages)

    def still_present(self, age_s: float, horizon_s: float) -> float:
        """P(a request `age_s` seconds into decode is still there `horizon_s` later)."""
        if horizon_s <= 0:
            return 1.0
        alive = self.survival(age_s)
        return 1.0 if alive <= 0 else self.survival(age_s + horizon_s) / alive


@dataclass(slots=True)
class DecodeLoad:
    """The Conductor's book of one decode instance: the requests in it and those on their way."""

    capacity_tokens: int
    active: dict[int, tuple[float, int]] = field(default_factory=dict)  # id -> (joined at, context tokens)
    active_tokens: int = 0  # the sum of the active requests' context tokens
    incoming: dict[int, tuple[float, int]] = field(default_factory=dict)  # id -> (due at, context tokens)


def expected_load(load: DecodeLoad, stages: DecodeStagePredictor, now: float, at: float) -> tuple[float, float]:
    """Expected (requests, their prompt tokens) in `load` at time `at`: each request counted
    with the probability that it is there then (the survival function); pure."""
    horizon = at - now
    count = context = 0.0
    for joined, tokens in load.active.values():
        p = stages.still_present(now - joined, horizon)
        count, context = count + p, context + p * tokens
    for due, tokens in load.incoming.values():
        if due <= at:
            p = stages.survival(at - due)
            count, context = count + p, context + p * tokens
    return count, context


def uniform_load(load: DecodeLoad, at: float, stage_s: float) -> tuple[float, float]:
    """(requests, their prompt tokens) in `load` at time `at` if every decode stage lasts
    `stage_s`: those that reached or will reach decode in (at - stage_s, at]; pure. NOTE: a
    request in decode for longer than `stage_s` counts as gone, even now."""
    count = context = 0
    since = at - stage_s
    for joined, tokens in load.active.values():
        if joined > since:
            count, context = count + 1, context + tokens
    for due, tokens in load.incoming.values():
        if since < due <= at:
            count, context = count + 1, context + tokens
    return float(count), float(context)
