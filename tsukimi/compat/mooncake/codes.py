"""Mooncake's status codes (0 or a size on success, negative on failure) and how tsukimi's
errors map onto them."""

from __future__ import annotations

from tsukimi.errors import (
    ConfigError,
    InvalidArgument,
    InvalidBufferError,
    LeaseHeld,
    ObjectExists,
    ObjectNotFound,
    OutOfBounds,
    OutOfSpace,
    TaskInFlight,
    TaskNotFound,
    TransferError,
    TsukimiError,
)

OK = 0
NO_SPACE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
OBJECT_HAS_REPLICATION_TASK = -708
TRANSFER_FAIL = -800
RPC_FAIL = -900
TASK_NOT_FOUND = -1400
_CODES: list[tuple[type[TsukimiError], int]] = [
    (TaskNotFound, TASK_NOT_FOUND),  # NOTE: before ObjectNotFound, its base class
    (TaskInFlight, OBJECT_HAS_REPLICATION_TASK),
    (OutOfSpace, NO_SPACE),
    (InvalidArgument, INVALID_PARAMS),
    (ConfigError, INVALID_PARAMS),
    (InvalidBufferError, INVALID_PARAMS),
    (OutOfBounds, INVALID_PARAMS),
    (ObjectNotFound, OBJECT_NOT_FOUND),
    (ObjectExists, OBJECT_ALREADY_EXISTS),
    (LeaseHeld, OBJECT_HAS_LEASE),
    (TransferError, TRANSFER_FAIL),
]


def code_of(error: TsukimiError | None) -> int:
    """Mooncake's error code for a tsukimi error (RPC_FAIL for network and master failures)."""
    if error is None:
        return OK
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return RPC_FAIL
