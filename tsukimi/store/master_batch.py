"""`call_batch`: several store operations in one master round trip (protocol.py's `Batch`).

Every part of a store client that works on many keys at once (client.py's gets and exists,
puts.py, parts.py, ranges.py) is given the client's `MasterLink` and sends its batches
through this one function; each operation gets its own result or `Failure`, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from tsukimi.store import protocol as p
from tsukimi.store.master_link import MasterLink

BatchOp = p.PutStart | p.PutEnd | p.PutRevoke | p.GetReplicas | p.Exists | p.Remove


def call_batch(link: MasterLink, ops: Sequence[BatchOp]) -> list[p.BatchResultItem]:
    """One master round trip for `ops`; no round trip at all for none.

    Args:
        link: the client's link to the master (the leader of an HA group).
        ops: at most `p.MAX_BATCH` operations (callers cut larger batches).
    Returns:
        Each operation's result, in order (a `p.Failure` for one that failed).
    Raises:
        Only for the whole call: RpcTimeout / MasterUnavailable, ProtocolError.
    """
    if not ops:
        return []
    return list(link.call_as(p.Batch(list(ops)), p.BatchResult).results)
