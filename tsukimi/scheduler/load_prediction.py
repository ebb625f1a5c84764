"""How long requests stay in decode, learned from the ones that finished: the Conductor's
system-level prediction of decode load (the paper predicts the load of the decode pool
rather than each request's output length, which is unknown at arrival).

The predictor keeps the most recent `window` observed decode-stage durations, sorted, and
answers with their empirical survival function: `survival(t)` = P(a stage lasts longer than
t), and `still_present(age, horizon)` = P(a request in decode for `age` seconds is still there
`horizon` seconds later) = S(age + horizon) / S(age). A request that has outlived every
observation is assumed to stay. Until anything is observed, stages are assumed to last
`prior_s`.
"""

from __future__ import annotations

import bisect
from collections import deque

from tsukimi.errors import ConfigError


class DecodeStagePredictor:
    """Not thread-safe; O(log n) queries, O(window) per observation."""

    def __init__(self, prior_s: float, window: int = 4096) -> None:
        if not prior_s > 0 or window < 1:
            raise ConfigError(f"the prior decode stage length must be > 0 and the window >= 1 ({prior_s}, {window})")
        self._prior_s = prior_s
        self._window: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []

    @property
    def observed(self) -> int:
        return len(self._sorted)

    def observe(self, duration_s: float) -> None:
        """A request left decode after `duration_s` seconds (mutates)."""
        if len(self._window) == self._window.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._window[0])]
        self._window.append(duration_s)
        bisect.insort(self._sorted, duration_s)

    def survival(self, t: float) -> float:
        """P(a decode stage lasts longer than `t` seconds)."""
        if t < 0:
            return 1.0
        if not self._sorted:
            return 1.0 if t < self._prior_s else 0.0
        return (len(self._sorted) - bisect.bisect_right(self._sorted, t)) / len(self._sorted)

    def still_present(self, age_s: float, horizon_s: float) -> float:
        """P(a request `age_s` seconds into decode is still there `horizon_s` later)."""
        if horizon_s <= 0:
            return 1.0
        alive = self.survival(age_s)
        return 1.0 if alive <= 0 else self.survival(age_s + horizon_s) / alive
