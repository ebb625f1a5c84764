"""The colocated baseline's routers."""

from __future__ import annotations

import pytest

from tsukimi.errors import ConfigError, InvalidArgument
from tsukimi.scheduler.baselines import LeastLoad, RoundRobin, make_router


def test_round_robin_ignores_load() -> None:
    router = RoundRobin()
    assert [router.route([9, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]


def test_least_load_picks_the_emptiest_first_on_ties() -> None:
    router = LeastLoad()
    assert router.route([3, 1, 1, 2]) == 1 and router.route([0, 0]) == 0


def test_bad_names_and_no_instances() -> None:
    assert make_router("least_load").name == "least_load"
    with pytest.raises(ConfigError):
        make_router("random")
    for router in (RoundRobin(), LeastLoad()):
        with pytest.raises(InvalidArgument):
            router.route([])
