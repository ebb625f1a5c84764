"""How long requests stay in decode, learned from the ones that finished: the Conductor's
system-level prediction of decode load (the paper predicts the load of the decode pool
rather than each request's output length, which is unknown at arrival).

The predictor keeps a histogram of observed decode-stage durations (1 s bins up to 30
minutes, longer ones in the last bin) and answers with its survival function:
`survival(t)` = P(a stage lasts longer than t), and `still_present(age, horizon)` =
P(a request in decode for `age` seconds is still there `horizon` seconds later) =
S(age + horizon) / S(age). A request that has outlived every observation is assumed to
stay. Until anything is observed, stages are assumed to last `prior_s`.
"""

from __future__ import annotations

import numpy as np

from tsukimi.errors import ConfigError

_BIN_S = 1.0
_BINS = 1800


class DecodeStagePredictor:
    """Not thread-safe; O(1) queries, O(bins) after each batch of observations."""

    def __init__(self, prior_s: float) -> None:
        if not prior_s > 0:
            raise ConfigError(f"the prior decode stage length must be > 0, got {prior_s}")
        self._counts = np.zeros(_BINS + 1, dtype=np.int64)
        self._prior_bin = min(_BINS, int(prior_s / _BIN_S))
        self._survival: list[float] | None = None
        self.observed = 0

    def observe(self, duration_s: float) -> None:
        """A request left decode after `duration_s` seconds (mutates)."""
        self._counts[min(_BINS, max(0, int(duration_s / _BIN_S)))] += 1
        self.observed += 1
        self._survival = None

    def survival(self, t: float) -> float:
        """P(a decode stage lasts longer than `t` seconds)."""
        if t <= 0:
            return 1.0
        if not self.observed:
            return 1.0 if int(t / _BIN_S) < self._prior_bin else 0.0
        if self._survival is None:  # S[k] = P(duration bin >= k): counts from bin k on
            tail = np.cumsum(self._counts[::-1])[::-1]
            self._survival = [*(tail / self.observed).tolist(), 0.0]  # NOTE: a list: scalar lookups are faster
        k = int(t / _BIN_S) + 1
        return self._survival[min(k, _BINS + 1)]

    def still_present(self, age_s: float, horizon_s: float) -> float:
        """P(a request `age_s` seconds into decode is still there `horizon_s` later)."""
        if horizon_s <= 0:
            return 1.0
        alive = self.survival(age_s)
        return 1.0 if alive <= 0 else min(1.0, self.survival(age_s + horizon_s) / alive)
