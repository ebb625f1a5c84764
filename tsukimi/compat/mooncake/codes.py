"""Mooncake's status codes (0 or a size on success, negative on failure) and how tsukimi's
errors map onto them."""

from __future__ import annotations

from tsukimi.errors import (
    ConfigError,
    ErrorTable,
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
INVALID_REPLICA = -702  # the wheel's answer to a put session ranges call with no fragment for a key
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707  # a get session read after its read lease ran out
OBJECT_HAS_REPLICATION_TASK = -708
TRANSFER_FAIL = -800
RPC_FAIL = -900
TASK_NOT_FOUND = -1400
# NOTE: the first class that matches wins: subclasses before their bases (ErrorTable checks).
_CODES: ErrorTable[int] = ErrorTable(
    [
        (TaskNotFound, TASK_NOT_FOUND),  # an ObjectNotFound
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
    ],
    default=RPC_FAIL,  # network and master failures
)


def code_of(error: TsukimiError | None) -> int:
    """Mooncake's error code for a tsukimi error (OK for None; RPC_FAIL for network and
    master failures). Pure."""
    return OK if error is None else _CODES.lookup(error)
