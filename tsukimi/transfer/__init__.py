"""The Transfer Engine: one-sided batched READ/WRITE between processes' registered memory.

Transports: shm (same host, direct copy from mapped shared memory) and tcp (a segment
server per process; slices striped over pooled connections). Segment descriptors are
published to a metadata backend (memory, http, etcd) or exchanged by handshake (p2p).
Peers can also deliver small notifications to each other and probe each other's liveness.
"""

from tsukimi.transfer.batch import (
    Batch,
    OpCode,
    RequestState,
    RequestStatus,
    SegmentHandle,
    TransferRequest,
    first_error,
)
from tsukimi.transfer.engine import TransferEngine
from tsukimi.transfer.notifications import Notification
from tsukimi.transfer.segment import RegisteredBuffer, SegmentDescriptor

__all__ = [
    "Batch",
    "Notification",
    "OpCode",
    "RegisteredBuffer",
    "RequestState",
    "RequestStatus",
    "SegmentDescriptor",
    "SegmentHandle",
    "TransferEngine",
    "TransferRequest",
    "first_error",
]
