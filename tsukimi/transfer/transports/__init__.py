"""Transports move slices of requests to and from a peer's segment (see base.py): `shm`
(same host, shared memory) and `tcp` (any host). Importing this package registers them."""

from tsukimi.transfer.transports import shm, tcp
from tsukimi.transfer.transports.base import (
    Slice,
    Transport,
    TransportContext,
    build_transports,
    register_transport,
    transport_names,
)

__all__ = [
    "Slice",
    "Transport",
    "TransportContext",
    "build_transports",
    "register_transport",
    "shm",
    "tcp",
    "transport_names",
]
