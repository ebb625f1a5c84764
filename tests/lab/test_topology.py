"""The topology file, the drop filter's program and the delay line's jitter: parsing, errors,
pure functions only."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from tsukimi.errors import ConfigError
from tsukimi.lab.delay_line import Jitter
from tsukimi.lab.shaping import drop_program, root_commands
from tsukimi.lab.topology import LinkShape, Topology, parse_rate, parse_topology

GOOD = """
[links]
default = { rate = "1gbit", delay = "0ms", jitter = "0ms", loss = "0%" }

[[hosts]]
name = "master"

[[hosts]]
name = "holder-a"
nics = 2
link = { rate = "100mbit" }
nic = [{}, { rate = "10mbit", loss = "1.5%" }]
"""


def test_a_topology_with_per_host_and_per_nic_overrides() -> None:
    topo = parse_topology(GOOD)
    assert [h.name for h in topo.hosts] == ["master", "holder-a"]
    assert topo.host("master").links == (LinkShape(rate_bps=1_000_000_000),)
    assert topo.host("holder-a").links == (
        LinkShape(rate_bps=100_000_000),
        LinkShape(rate_bps=10_000_000, loss_pct=1.5),
    )
    assert topo.num_nics == 2


def test_units() -> None:
    assert parse_rate("1.5gbit") == 1_500_000_000
    assert parse_rate("800kbit") == 800_000
    assert parse_rate("unlimited") == 0
    shape = LinkShape().with_settings({"jitter": "250us", "delay": "1s"}, "t")  # NOTE: any order
    assert (shape.delay_ms, shape.jitter_ms) == (1000.0, 0.25)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[hosts]]\nname = 'a'\nnics = 3", "nics must be 1 or 2"),
        ("[[hosts]]\nname = 'hub'", "not 'hub'"),
        ("[[hosts]]\nname = 'A_b'", "host name must be"),
        ("[[hosts]]\nname = 'a'\n[[hosts]]\nname = 'a'", "given more than once: a"),
        ("[[hosts]]\nname = 'a'\ncolour = 'red'", "unknown keys ['colour']"),
        ("[[hosts]]\nname = 'a'\nlink = { rate = '1 gigabit' }", "rate must look like"),
        ("[[hosts]]\nname = 'a'\nlink = { latency = '5ms' }", "unknown link keys ['latency']"),
        ("[[hosts]]\nname = 'a'\nlink = { loss = '101%' }", "loss is a percentage"),
        ("[[hosts]]\nname = 'a'\nlink = { delay = 5 }", "delay must be a string"),
        ("[[hosts]]\nname = 'a'\nlink = { delay = '1ms', jitter = '2ms' }", "exceeds its delay"),
        ("[[hosts]]\nname = 'a'\nnic = [{}, {}]", "at most 1 tables"),
        ("[links]\nfast = {}\n[[hosts]]\nname = 'a'", "valid: default"),
        ("[network]\n", "unknown top-level keys ['network']"),
        ("", "at least one [[hosts]]"),
        ("[[hosts]\n", "not valid TOML"),
    ],
)
def test_bad_topologies_name_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_topology(text)
    assert message in str(info.value)


def test_unknown_host_names_the_hosts() -> None:
    with pytest.raises(ConfigError, match="hosts: a, b"):
        Topology.of("a", "b").host("c")


def test_drop_program_layout() -> None:
    assert drop_program(0.0, ()) is None
    assert drop_program(100.0, ()) == "3,6 0 0 2,6 0 0 4294967295,6 0 0 2"
    # ldh [12]; jeq IPv4 else pass; ld [30]; jeq 10.0.0.2 -> drop; pass; drop
    assert (
        drop_program(0.0, ["10.0.0.2"]) == "6,40 0 0 12,21 0 2 2048,32 0 0 30,21 1 0 167772162,6 0 0 4294967295,6 0 0 2"
    )
    loss = drop_program(50.0, ["10.0.0.2", "10.0.0.3"])
    assert loss is not None and loss.startswith("9,32 0 0 4294963256,37 6 0 2147483647,")


def test_root_commands() -> None:
    plain = root_commands("ns", "eth0", LinkShape(rate_bps=100_000_000))
    assert plain == [
        ["tc", "-n", "ns", "qdisc", "del", "dev", "eth0", "root"],
        [
            *("tc", "-n", "ns", "qdisc", "add", "dev", "eth0", "root", "handle", "1:"),
            *("tbf", "rate", "100000000bit", "burst", "98304", "latency", "50ms"),
        ],
    ]
    assert root_commands("ns", "eth0", LinkShape(rate_bps=0))[1:] == []
    # NOTE: delay is a delay line's (tsukimi/lab/delay_line.py), never tc's: the same tbf as without
    gbit = [*plain[1][:-7], "tbf", "rate", "1000000000bit", "burst", "500000", "latency", "50ms"]
    assert root_commands("ns", "eth0", LinkShape(delay_ms=50.0, jitter_ms=5.0)) == [plain[0], gbit]


def test_which_shapes_need_a_delay_line() -> None:
    assert not LinkShape().delayed and not LinkShape(rate_bps=0, loss_pct=5.0).delayed
    assert LinkShape(delay_ms=0.1).delayed and LinkShape(delay_ms=5.0, jitter_ms=5.0).delayed


def test_a_shape_in_one_line() -> None:
    assert LinkShape().summary == "1000 Mbit/s"
    assert LinkShape(rate_bps=0, delay_ms=25.0, jitter_ms=2.5, loss_pct=1.0).summary == (
        "unshaped, 25 ms +- 2.5 ms delay, 1 % loss"
    )
    assert LinkShape(delay_ms=50.0).summary == "1000 Mbit/s, 50 ms delay"


def test_jitter_wanders_within_its_span_around_the_delay_and_never_reorders() -> None:
    """Frames every 0.5 ms for 20 s under +-10 ms: each offset within the span, the mean near
    0 (the delay itself), spread over most of the span, release times strictly rising."""
    jitter = Jitter(random.Random(24))
    arrivals_s = [i * 0.0005 for i in range(40_000)]
    offsets_ms = [jitter.offset_s(t, 10.0) * 1000 for t in arrivals_s]
    assert all(-10.0 <= o <= 10.0 for o in offsets_ms)
    assert abs(statistics.mean(offsets_ms)) < 1.5
    deciles = statistics.quantiles(offsets_ms, n=10)
    assert deciles[-1] - deciles[0] > 8.0, deciles
    releases = [t + o / 1000 for t, o in zip(arrivals_s, offsets_ms, strict=True)]
    assert all(b > a for a, b in itertools.pairwise(releases))
    now = jitter.offset_s(30.0, 10.0)
    assert jitter.offset_s(30.0, 10.0) == now  # NOTE: no time passed, no step
    assert jitter.offset_s(31.0, 0.0) == 0.0
