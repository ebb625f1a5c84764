"""The per-request term of the Conductor's TTFT estimate: what a request spends outside the
engine steps its cost model prices (the router's and the workers' HTTP hops, tokenizing,
publishing its KV to the pool, the first token's way back), learned from the requests
themselves.

    raw prediction   the Conductor's TTFT of queue + prefill + transfer (+ a queued wait),
                     turned into the time the first token is expected: booked at + raw TTFT
    error            when the first token came - when it was expected, for every request
                     whose first token the caller reports (`Conductor.first_token`)
    estimate         the `quantile` (0.9) of the errors of the last `window` requests seen
                     within `horizon_s`, at least 0; `prior_s` when there are none (a
                     start-up measurement, or 0)

The Conductor adds the estimate to every TTFT it predicts (so to every SLO check and to the
wait a queued request is told), and errors are measured against the raw prediction, so the
term does not feed on itself. A high quantile rather than the mean: the SLO is met per
request, and a prediction that is late one time in ten meets a 95 % goal only with margin
elsewhere. Old errors expire (`horizon_s`): were everything rejected for a while no error
would come to correct a bad estimate, and the prior takes over again.

Pure and driven by the caller's `now`, like the Conductor; not thread-safe.
"""

from __future__ import annotations

from collections import deque

from tsukimi.errors import ConfigError
from tsukimi.quantiles import quantile


class TtftOverhead:
    """The learned per-request TTFT term (see the module).

    Args:
        prior_s: the estimate before any error is seen (or after they all expired).
        window: how many of the newest errors count.
        horizon_s: how old an error may be and still count.
        q: the quantile of the errors taken.
        cap_s: the largest estimate (a broken measurement must not reject everything).
    """

    def __init__(
        self, prior_s: float = 0.0, window: int = 64, horizon_s: float = 60.0, q: float = 0.9, cap_s: float = 10.0
    ) -> None:
        if prior_s < 0 or window < 1 or horizon_s <= 0 or not 0 < q <= 1 or cap_s < 0:
            raise ConfigError(
                f"bad TTFT overhead settings: prior {prior_s}, window {window}, horizon {horizon_s}, q {q}, cap {cap_s}"
            )
        self.prior_s, self.horizon_s, self.q, self.cap_s = prior_s, horizon_s, q, cap_s
        self._errors: deque[tuple[float, float]] = deque(maxlen=window)  # (when seen, error s)

    def observe(self, now: float, error_s: float) -> None:
        """A first token came `error_s` after it was expected (negative: before). Mutates."""
        self._errors.append((now, error_s))

    def estimate_s(self, now: float) -> float:
        """The term to add to a TTFT predicted at `now` (pure but for forgetting old errors)."""
        while self._errors and self._errors[0][0] < now - self.horizon_s:
            self._errors.popleft()
        if not self._errors:
            return self.prior_s
        return min(self.cap_s, max(0.0, quantile((e for _, e in self._errors), self.q)))

    @property
    def observed(self) -> int:
        """Errors held now (some may have expired since the last `estimate_s`)."""
        return len(self._errors)
