"""The per-job term of a prefill instance's service: what serving a prompt costs beyond the
engine steps the Conductor's cost model prices (the router's and the worker's HTTP hops,
publishing the prompt's KV to the pool, the first token's way back), learned from the jobs
themselves.

    engine time   the cost model's prefill (+ transfer) of a job, as booked
    error         its end (the first token, as the caller reports the prefill done) - when it
                  began (when it was booked, or when the instance's previous job ended: one job
                  at a time) - its engine time
    estimate      the `q` quantile (the median) of the errors of the last `window` jobs seen
                  within `horizon_s`, at least 0, at most `cap_s`; `prior_s` when there are none
                  (the router's start-up probe, or 0)

The Conductor adds the estimate to every prefill it books (`Decision.prefill_s`), so it counts
in the request's TTFT and in the queue of those behind it: on a worker that serves prompts one
at a time, the time outside its engine steps delays them all. The median, not a high
quantile: it adds up over a queue. Errors are measured against the engine time alone, so the
term does not feed on itself; old ones expire (`horizon_s`): were everything rejected for a
while no error would come to correct a bad estimate, and the prior takes over again.

Pure and driven by the caller's `now`, like the Conductor; not thread-safe.
"""

from __future__ import annotations

from collections import deque

from tsukimi.errors import ConfigError
from tsukimi.quantiles import quantile


class ServiceTerm:
    """The learned per-job prefill term (see the module).

    Args:
        prior_s: the estimate before any error is seen (or after they all expired).
        window: how many of the newest errors count.
        horizon_s: how old an error may be and still count.
        q: the quantile of the errors taken.
        cap_s: the largest estimate (a broken measurement must not reject everything).
    """

    def __init__(
        self, prior_s: float = 0.0, window: int = 64, horizon_s: float = 60.0, q: float = 0.5, cap_s: float = 10.0
    ) -> None:
        if prior_s < 0 or window < 1 or horizon_s <= 0 or not 0 < q <= 1 or cap_s < 0:
            raise ConfigError(
                f"bad service term settings: prior {prior_s}, window {window}, horizon {horizon_s}, q {q}, cap {cap_s}"
            )
        self.prior_s, self.horizon_s, self.q, self.cap_s = prior_s, horizon_s, q, cap_s
        self._errors: deque[tuple[float, float]] = deque(maxlen=window)  # (when seen, error s)

    def observe(self, now: float, error_s: float) -> None:
        """A job ended `error_s` later than its engine time (negative: sooner). Mutates."""
        self._errors.append((now, error_s))

    def estimate_s(self, now: float) -> float:
        """The term to add to a prefill booked at `now` (pure but for forgetting old errors)."""
        while self._errors and self._errors[0][0] < now - self.horizon_s:
            self._errors.popleft()
        if not self._errors:
            return self.prior_s
        return min(self.cap_s, max(0.0, quantile((e for _, e in self._errors), self.q)))

    @property
    def observed(self) -> int:
        """Errors held now (some may have expired since the last `estimate_s`)."""
        return len(self._errors)
