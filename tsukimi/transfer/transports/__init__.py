"""Transports move slices of requests to and from a peer's segment (see base.py):
`device_ipc` (same host, device memory: CUDA IPC), `shm` (same host, shared memory), `cma`
(same host, any host memory: process_vm_readv/writev) and `tcp` (any host; device memory
staged through pinned chunks), tried by `auto` in that order. Importing this package
registers them."""

from tsukimi.transfer.transports import cma, device_ipc, shm, tcp
from tsukimi.transfer.transports.base import (
    Preparable,
    PreparedItem,
    SegmentAware,
    Slice,
    Transport,
    TransportContext,
    Waitable,
    build_transports,
    register_transport,
    transport_names,
)

__all__ = [
    "Preparable",
    "PreparedItem",
    "SegmentAware",
    "Slice",
    "Transport",
    "TransportContext",
    "Waitable",
    "build_transports",
    "cma",
    "device_ipc",
    "register_transport",
    "shm",
    "tcp",
    "transport_names",
]
