"""How much KV memory a simulated decode instance reserves for a request's output, which it
does not know in advance (the trace's real output length is an oracle no engine has).

Policies (`SimConfig.reservation`):

- "oracle": the real output length (the comparison point; the simulator's old behaviour);
- "max_tokens": the request's cap, `SimConfig.max_output_tokens` (vLLM's worst case);
- "mean" / "p90": the mean / 90th percentile of the output lengths observed so far in the
  cluster (the last 1,000 finished requests; the cap until one has finished).

A request whose output outgrows its reservation asks for `GROWTH_TOKENS` more at a time; when
the instance has no room it is preempted: its KV is dropped, it goes back to the head of the
instance's queue with the tokens generated so far, and when it rejoins the batch its prompt and
those tokens are recomputed in that step (vLLM's preemption by recompute).
"""

from __future__ import annotations

import math

from tsukimi.config import ReservationName
from tsukimi.scheduler.load_prediction import SlidingWindow

GROWTH_TOKENS = 512  # one block of the traces: what an outgrown reservation asks for each time
_WINDOW = 1000


class ReservationPolicy:
    """Output tokens to reserve for a request joining decode; learns from finished ones.
    Shared by the decode instances of one simulation. Not thread-safe."""

    def __init__(self, name: ReservationName, max_output_tokens: int) -> None:
        self.name, self.max_output_tokens = name, max_output_tokens
        self._observed = SlidingWindow(_WINDOW)

    def output_tokens(self, true_output_tokens: int, generated: int) -> int:
        """Output tokens to reserve for a request that has `generated` already (1 when it
        comes from prefill; more when it rejoins after a preemption); pure."""
        if self.name == "oracle":
            return true_output_tokens
        guess = float(self.max_output_tokens)
        if self.name != "max_tokens" and len(self._observed):
            guess = self._observed.mean() if self.name == "mean" else self._observed.quantile(0.9)
        guess = min(math.ceil(guess), self.max_output_tokens)
        return max(guess, generated + GROWTH_TOKENS if generated > 1 else generated + 1)

    def observe(self, output_tokens: int) -> None:
        """A request finished with `output_tokens` (mutates)."""
        self._observed.observe(float(output_tokens))
