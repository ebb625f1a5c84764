"""Replicas in this client's own segment, moved with a memcpy on the caller's thread.

A replica the master placed in the reader's (or writer's) own segment needs no transport:
its bytes are this process's memory (copied by transfer/copies.py). Mooncake's client does
the same (its LOCAL_MEMCPY strategy); going through the Transfer Engine instead would cost a
request, a route and a slice per part for what is one memcpy (issue 25's TP 1 HiCache
figures: every page of one rank sits in its own segment).

    view = local_view(engine, replica.te_segment, replica.address, size)   # None: not ours
    if view is not None:
        scatter(view, parts)                        # a get: the replica into the parts, in order
        gather(parts, view)                         # a put: the parts into the replica

A range that is not inside a registered host buffer of ours (a holder's stale address, device
memory) gets None: the Transfer Engine then moves it and reports what is wrong, as it does for
any peer.
"""

from __future__ import annotations

from collections.abc import Sequence

from tsukimi.errors import TsukimiError
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.copies import copy_bytes


def local_view(engine: TransferEngine, te_segment: str, address: int, size: int) -> memoryview | None:
    """The host bytes [address, address + size) of segment `te_segment` when that is this
    engine's own; None when it is another's, device memory, or not registered here (pure)."""
    if te_segment != engine.name:
        return None
    try:
        found = engine.local_memory(address, size)
    except TsukimiError:  # OutOfBounds: let the engine's path report it
        return None
    return found if isinstance(found, memoryview) else None


def scatter(view: memoryview, parts: Sequence[bytearray | memoryview]) -> None:
    """Copy `view` into `parts` (flat byte views), in order; their sizes add up to `view`'s
    (the caller checked)."""
    offset = 0
    for part in parts:
        copy_bytes(part, view[offset : offset + len(part)])
        offset += len(part)


def gather(parts: Sequence[bytearray | memoryview], view: memoryview) -> None:
    """Copy `parts` (flat byte views), in order, into `view`; their sizes add up to `view`'s
    (the caller checked)."""
    offset = 0
    for part in parts:
        copy_bytes(view[offset : offset + len(part)], part)
        offset += len(part)
