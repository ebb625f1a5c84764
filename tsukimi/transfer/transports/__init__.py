"""Transports move slices of requests to and from a peer's segment (see base.py): `shm`
(same host, shared memory), `cma` (same host, any memory: process_vm_readv/writev) and `tcp`
(any host), tried by `auto` in that order. Importing this package registers them."""

from tsukimi.transfer.transports import cma, shm, tcp
from tsukimi.transfer.transports.base import (
    Preparable,
    PreparedItem,
    SegmentAware,
    Slice,
    Transport,
    TransportContext,
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
    "build_transports",
    "cma",
    "register_transport",
    "shm",
    "tcp",
    "transport_names",
]
