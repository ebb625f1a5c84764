"""Routing for the colocated (vLLM-like) baseline: each instance prefills and decodes and
keeps only its own prefix cache, so a router needs no index, only the instances' loads.

A `RoutingPolicy` picks an instance for each arriving request from their current loads
(requests waiting, prefilling or decoding there). Deterministic: ties go to the lowest index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tsukimi.errors import ConfigError, InvalidArgument


class RoutingPolicy(Protocol):
    name: str

    def route(self, loads: Sequence[int]) -> int:
        """The index of the instance the next request goes to (mutates the policy's state)."""
        ...


class RoundRobin:
    """Each instance in turn, whatever its load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, loads: Sequence[int]) -> int:
        if not loads:
            raise InvalidArgument("no instance to route to")
        chosen = self._next % len(loads)
        self._next = chosen + 1
        return chosen


class LeastLoad:
    """The instance with the fewest requests."""

    name = "least_load"

    def route(self, loads: Sequence[int]) -> int:
        if not loads:
            raise InvalidArgument("no instance to route to")
        return min(range(len(loads)), key=loads.__getitem__)


def make_router(name: str) -> RoutingPolicy:
    """Raises ConfigError for a name other than "round_robin" or "least_load"."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ConfigError(f"unknown router {name!r}: expected round_robin or least_load")
