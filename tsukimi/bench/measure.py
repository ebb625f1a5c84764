"""Warm up, then measure: the benches' one way of repeating a measurement and summarizing it.

    repeat(run, warmup_runs=1, repeats=5)     run(-1) (dropped), run(0) .. run(4) (kept)
    Spread.of(samples)                         median (nearest rank), min, max, count
    rate(step, warmup_s, duration_s)           units per second of `step` over duration_s,
                                               after warmup_s of it (a transfer loop's GB/s)

`run` gets the run's index (negative for warm-up runs), so a bench can give each run its own
input (a fresh prompt) and the warm-up inputs of its own; the medians are tsukimi/quantiles.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from tsukimi.errors import ConfigError
from tsukimi.quantiles import quantile

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Spread:
    """A figure measured `count` times: its median (nearest rank), lowest and highest value."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Spread:
        """The spread of `samples` (NaN ones left out; all NaN when none is left). Pure."""
        values = [s for s in samples if s == s]
        if not values:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(quantile(values, 0.5), min(values), max(values), len(values))

    @property
    def relative(self) -> float:
        """(high - low) / median: how far apart the runs were (NaN without a median)."""
        return (self.high - self.low) / self.median if self.median else float("nan")


def repeat(run: Callable[[int], T], *, repeats: int, warmup_runs: int = 0, warmup_s: float = 0.0) -> list[T]:
    """Warm up with `warmup_runs` runs (then more runs until `warmup_s` passed), drop what they
    gave, then `repeats` runs; what the kept runs gave, in order. Warm-up runs get indices
    -warmup_runs.. -1 (further time-based ones keep counting down), kept runs 0 .. repeats - 1.

    Raises:
        ConfigError: repeats < 1, or a negative warm-up.
    """
    if repeats < 1 or warmup_runs < 0 or warmup_s < 0:
        raise ConfigError(f"repeats must be >= 1 and warm-ups >= 0 (got {repeats}, {warmup_runs}, {warmup_s})")
    start = time.perf_counter()
    for index in range(-warmup_runs, 0):
        run(index)
    index = -warmup_runs - 1
    while time.perf_counter() - start < warmup_s:
        run(index)
        index -= 1
    return [run(index) for index in range(repeats)]


def rate(step: Callable[[], int], warmup_s: float, duration_s: float) -> float:
    """Calls `step` (which returns the units it moved: bytes, requests) for `warmup_s`, then
    for `duration_s` more; units per second over the second stretch (whole steps only).

    Raises:
        ConfigError: duration_s <= 0 or warmup_s < 0.
    """
    if duration_s <= 0 or warmup_s < 0:
        raise ConfigError(f"duration must be > 0 and warm-up >= 0 (got {duration_s}, {warmup_s})")
    warm_until = time.perf_counter() + warmup_s
    while time.perf_counter() < warm_until:
        step()
    moved, start = 0, time.perf_counter()
    while (now := time.perf_counter()) - start < duration_s:
        moved += step()
    return moved / (now - start)
