"""The Transfer Engine's status codes in Mooncake's Python API (0 on success, negative on
failure; not the store's codes in codes.py) and how tsukimi's errors map onto them.

The values are Mooncake's public ones (what its `mooncake.engine` returns: an unknown peer in
p2p mode gives ERR_DNS_FAIL, a refused connection ERR_SOCKET, an unknown segment with a
metadata server ERR_METADATA, an address never registered ERR_ADDRESS_NOT_REGISTERED).
"""

from __future__ import annotations

import logging
import socket

from tsukimi.errors import (
    AuthError,
    BrokenConnectionError,
    ErrorTable,
    MetadataError,
    ProtocolError,
    RpcTimeout,
    SegmentNotFound,
    TsukimiError,
)

logger = logging.getLogger(__name__)

OK = 0
FAILED = -1  # what the Python API returns for any failed transfer (Mooncake's generic failure)
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_DNS_FAIL = -101
ERR_SOCKET = -102
ERR_MALFORMED_JSON = -103
ERR_REJECT_HANDSHAKE = -104
ERR_METADATA = -200

# NOTE: the first class that matches wins: subclasses before their bases (ErrorTable checks).
_CODES: ErrorTable[int] = ErrorTable(
    [
        (SegmentNotFound, ERR_METADATA),
        (MetadataError, ERR_METADATA),
        (AuthError, ERR_REJECT_HANDSHAKE),
        (ProtocolError, ERR_MALFORMED_JSON),
        (BrokenConnectionError, ERR_SOCKET),
        (RpcTimeout, ERR_SOCKET),
    ],
    default=ERR_INVALID_ARGUMENT,  # Mooncake's generic failure
)


def code_of(error: TsukimiError) -> int:
    """Mooncake's Transfer Engine code for a tsukimi error (ERR_INVALID_ARGUMENT when no
    closer one exists: Mooncake's generic failure). A p2p peer that is not found because its
    name does not resolve, or its address refuses, gives ERR_DNS_FAIL / ERR_SOCKET, as Mooncake."""
    if isinstance(error, SegmentNotFound) and isinstance(error.__cause__, OSError):
        return ERR_DNS_FAIL if isinstance(error.__cause__, socket.gaierror) else ERR_SOCKET
    return _CODES.lookup(error)


def failed(what: str, error: TsukimiError, code: int | None = None) -> int:
    """Log why `what` failed (Mooncake logs its failures too) and return its code."""
    logger.error("%s failed: %s", what, error)
    return code_of(error) if code is None else code
