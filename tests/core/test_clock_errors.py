"""The clock abstraction and the error hierarchy's wire round trip."""

from __future__ import annotations

import pytest

from tsukimi import errors
from tsukimi.clock import VirtualClock, WallClock


def test_virtual_clock_moves_only_when_told() -> None:
    clock = VirtualClock(10.0)
    assert clock.now() == 10.0
    clock.sleep(2.5)
    assert clock.advance(0.5) == 13.0
    clock.set(20.0)
    assert clock.now() == 20.0
    with pytest.raises(ValueError):
        clock.advance(-1)
    with pytest.raises(ValueError):
        clock.set(19.0)


def test_wall_clock_is_monotonic() -> None:
    clock = WallClock()
    first = clock.now()
    clock.sleep(0.001)
    assert clock.now() > first


@pytest.mark.parametrize(
    "cls",
    [
        errors.OutOfBounds,
        errors.SegmentNotFound,
        errors.RpcTimeout,
        errors.ProtocolError,
        errors.ClosedError,
        errors.WorkerError,
        errors.WorkerUnavailable,
        errors.KVFormatError,
        errors.ModelNotFound,
    ],
)
def test_errors_cross_the_wire_as_the_same_class(cls: type[errors.TsukimiError]) -> None:
    again = errors.error_from_code(cls.code, "message")
    assert type(again) is cls and str(again) == "message"


def test_rejected_crosses_the_wire_with_its_reason() -> None:
    sent = errors.Rejected("ttft_slo")
    again = errors.error_from_code(sent.code, str(sent))
    assert type(again) is errors.Rejected and again.reason == "ttft_slo" and str(again) == str(sent)


def test_unknown_codes_become_peer_errors() -> None:
    again = errors.error_from_code("martian", "hi")
    assert type(again) is errors.PeerError and "martian" in str(again)


def test_error_codes_are_unique() -> None:
    codes = [cls.code for cls in errors._all_subclasses(errors.TsukimiError)]
    assert len(codes) == len(set(codes))


def test_builtin_bases_let_callers_catch_broadly() -> None:
    assert issubclass(errors.RpcTimeout, TimeoutError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.OutOfBounds, IndexError)
