"""The connector's numbers, reported through vLLM's connector stats (`KVConnectorStats`):
vLLM's logger prints `reduce()` of each interval next to its own throughput line.

`StatsRecorder` is the worker's thread-safe tally (loads and saves finish on threads);
`take()` empties it into a `TsukimiConnectorStats` once per step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "num_loads",
    "load_blocks",
    "load_failed_blocks",
    "load_errors_reported",
    "num_puts",
    "put_objects",
    "put_failed_objects",
    "put_s",
    "save_wait_s",
)
SOURCES = ("pool", "direct")


@dataclass
class TsukimiConnectorStats(KVConnectorStats):  # type: ignore[misc]  # vLLM is untyped here
    """Counters of one interval (sums; times in seconds)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            empty: float | list[float] = [] if isinstance(value, list) else 0
            self.data[key] = self.data.get(key, empty) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """Counters, and per load source the p50 and max of the load times (ms)."""
        out: dict[str, int | float] = {key: self.data[key] for key in COUNTERS if self.data.get(key)}
        for source in SOURCES:
            times = sorted(self.data.get(f"{source}_load_ms", []))
            if times:
                out[f"{source}_load_ms_p50"] = round(times[len(times) // 2], 3)
                out[f"{source}_load_ms_max"] = round(times[-1], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsRecorder:
    """Thread-safe counters of the worker (mutated by its load and save threads)."""

    def __init__(self) -> None:
        self._data: dict[str, float] = {}
        self._times: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _add(self, **values: float) -> None:
        with self._lock:
            for key, value in values.items():
                self._data[key] = self._data.get(key, 0) + value

    def loaded(self, source: str, num_blocks: int, num_failed: int, seconds: float) -> None:
        """One request's load from `source` ("pool" or "direct")."""
        self._add(num_loads=1, load_blocks=num_blocks, load_failed_blocks=num_failed)
        with self._lock:
            self._times.setdefault(f"{source}_load_ms", []).append(1000 * seconds)

    def load_errors(self, num_blocks: int) -> None:
        self._add(load_errors_reported=num_blocks)

    def saved(self, num_objects: int, num_failed: int, seconds: float) -> None:
        self._add(num_puts=1, put_objects=num_objects, put_failed_objects=num_failed, put_s=seconds)

    def save_waited(self, seconds: float) -> None:
        self._add(save_wait_s=seconds)

    def take(self) -> TsukimiConnectorStats | None:
        """The counters since the last call, or None when nothing happened (mutates)."""
        with self._lock:
            data: dict[str, Any] = {**self._data, **self._times}
            self._data, self._times = {}, {}
        return TsukimiConnectorStats(data=data) if data else None
