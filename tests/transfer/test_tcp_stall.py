"""A tcp path that dies silently (no reset, no progress) while another is up: its slices move to
the other path, by the deadline or well before; a slow but alive path is not declared dead and
never corrupts a byte; every path silent ends with a clear error by the deadline. The second
path is `PathProxy` on 127.0.0.2 (path_proxy.py); the policy is also checked on its own."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.transfer.path_proxy import PathProxy
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.metadata import SEGMENT_PREFIX
from tsukimi.transfer.metadata.memory import MemoryMetadata
from tsukimi.transfer.segment import Endpoint, encode_descriptor
from tsukimi.transfer.transports.tcp_stall import StallPolicy

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20
SIZE = 16 * MIB
DEADLINE_S = 10.0


class TwoPaths:
    """An owner engine on 127.0.0.1, reached by a user engine over two paths: the owner's own
    endpoint and `proxy` (or two proxies, `direct=False`)."""

    def __init__(
        self, rate_bps: float | None = None, direct: bool = True, stall_s: float = 0.5, connect_timeout_s: float = 3.0
    ) -> None:
        self.owner = TransferEngine("owner", Config(metadata=MetadataConfig(url=f"memory://{uuid.uuid4().hex}")))
        self.buf = self.owner.allocate(SIZE)
        desc = self.owner.describe()
        self.proxies = [PathProxy(desc.endpoints[0], rate_bps)]
        if not direct:
            self.proxies.append(PathProxy(desc.endpoints[0], rate_bps))
        endpoints: list[Endpoint] = [p.endpoint for p in self.proxies]
        if direct:
            endpoints.insert(0, desc.endpoints[0])
        store = uuid.uuid4().hex
        # NOTE: another host's name, so that tcp is used and not the same-host paths
        published = msgspec.structs.replace(desc, host_id="another-host", endpoints=endpoints)
        MemoryMetadata.named(store).put(SEGMENT_PREFIX + "owner", encode_descriptor(published))
        transfer = TransferConfig(
            transport="tcp",
            num_connections=4,
            slice_bytes=256 << 10,
            timeout_s=DEADLINE_S,
            stall_s=stall_s,
            connect_timeout_s=connect_timeout_s,
        )
        self.user = TransferEngine("user", Config(transfer, MetadataConfig(url=f"memory://{store}")))

    def write(self, data: np.ndarray) -> float:
        start = time.monotonic()
        self.user.write("owner", self.buf.base, data)
        return time.monotonic() - start

    def read(self) -> np.ndarray:
        back = np.zeros(SIZE, np.uint8)
        self.user.read("owner", self.buf.base, back)
        return back

    def close(self) -> None:
        self.user.close()
        for proxy in self.proxies:
            proxy.close()
        self.owner.close()


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(24).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def paths() -> Iterator[TwoPaths]:
    # NOTE: a cut proxy accepts but never greets, so a reconnect through it hangs for the whole
    # connect timeout: made longer than the bound below, a round that waited on one would show
    made = TwoPaths(rate_bps=400e6, connect_timeout_s=8.0)
    yield made
    made.close()


ROUND_BOUND_S = 2.5  # NOTE: stall_s (0.5 s) and ticks, far below the deadline and the connect timeout


def test_a_path_cut_mid_transfer_moves_its_slices_to_the_other(paths: TwoPaths, data: np.ndarray) -> None:
    """Stalled slices move (round 0); later rounds never wait on a reconnect through the cut
    path: it is probed in the background while the other path carries the batch."""
    paths.write(data)  # every connection up, half of them through the proxy
    assert paths.proxies[0].connections == 2
    paths.proxies[0].cut.set()
    for round_no in range(4):
        data[:] = round_no + 1
        took_s = paths.write(data)
        assert took_s < ROUND_BOUND_S, f"round {round_no}: {took_s:.2f} s, slices waited on the cut path"
        assert np.array_equal(np.frombuffer(paths.buf.view, np.uint8), data)
        assert np.array_equal(paths.read(), data)
        time.sleep(0.5)  # NOTE: past SUSPECT_S by round 2: the cut path is tried (probed) again


def test_a_slow_but_alive_path_completes_byte_exact_and_is_not_declared_dead(data: np.ndarray) -> None:
    slow = TwoPaths(rate_bps=40e6)  # NOTE: 5 MB/s: a 256 KiB slice's answer takes ~50 ms, 8 in flight 0.4 s
    try:
        for round_no in range(2):
            data[:] = round_no + 7
            slow.write(data)
            assert np.array_equal(np.frombuffer(slow.buf.view, np.uint8), data)
            assert np.array_equal(slow.read(), data)
        assert slow.proxies[0].connections == 2, "the slow path's connections were broken as stalled"
    finally:
        slow.close()


def test_every_path_silent_ends_with_a_clear_error_by_the_deadline(data: np.ndarray) -> None:
    both = TwoPaths(direct=False)
    try:
        for proxy in both.proxies:
            proxy.cut.set()
        start = time.monotonic()
        status = both.user.transfer([TransferRequest(OpCode.WRITE, "owner", both.buf.base, data)], timeout_s=2.0)[0]
        took_s = time.monotonic() - start
        assert status.state in (RequestState.TIMED_OUT, RequestState.FAILED), status
        assert status.error, status
        assert took_s < 2.0 + 1.5, took_s
    finally:
        both.close()


def test_one_silent_path_alone_waits_for_the_deadline_not_less() -> None:
    """With nothing to compare with and the peer's kernel answering, silence is not a stall:
    a slow server keeps its request until the deadline (the lone rule needs an unanswered peer)."""
    policy = StallPolicy(stall_s=0.5, lone_stall_s=4.0)
    assert not policy.stalled(100.0, other_path_progressed=False, peer_unanswered=False)
    assert policy.stalled(4.0, other_path_progressed=False, peer_unanswered=True)
    assert not policy.stalled(0.49, other_path_progressed=True, peer_unanswered=True)


@given(
    silent_s=st.floats(0, 100),
    more_s=st.floats(0, 100),
    other=st.booleans(),
    unanswered=st.booleans(),
    stall_s=st.floats(0.1, 10),
)
def test_stall_policy_is_monotonic_and_never_fires_before_stall_s(
    silent_s: float, more_s: float, other: bool, unanswered: bool, stall_s: float
) -> None:
    policy = StallPolicy(stall_s, 8 * stall_s)
    if policy.stalled(silent_s, other, unanswered):
        assert silent_s >= stall_s
        assert policy.stalled(silent_s + more_s, other, unanswered)
        assert policy.stalled(silent_s, True, unanswered) and policy.stalled(silent_s, other, True)


@pytest.mark.parametrize("bad", [0.0, 0.05, -1.0, 4000.0])
def test_stall_s_is_validated(bad: float) -> None:
    with pytest.raises(ConfigError, match="stall_s"):
        TransferConfig(stall_s=bad)
