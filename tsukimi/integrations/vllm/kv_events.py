"""vLLM's KV cache events (its ZMQ publisher, `--kv-events-config`) applied to the Conductor's
prefix index, in order, resynchronised after a gap.

vLLM's wire format is the one tsukimi's own workers publish: the ordering, gap detection and
resync are tsukimi/scheduler/index_sync.py's, the sockets tsukimi/serving/kv_events.py's.
What is vLLM's here: its hashes (bytes or int) keyed by `event_key`, its media (GPU -> hbm,
CPU -> dram, STORAGE -> ssd), and its replay socket, which answers `(b"", start seq)` with
every buffered `(b"", topic, seq, payload)` from that seq on, then `(b"", b"", -1, b"")`.
"""

from __future__ import annotations

from tsukimi.scheduler.index_sync import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventStats,
    InstanceEvents,
    KvEvent,
    KvEventBatch,
    Outcome,
    decode_batch,
)
from tsukimi.serving.kv_events import END_SEQ, EventSource, EventSubscriber

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventSource",
    "EventStats",
    "EventSubscriber",
    "InstanceEvents",
    "KvEvent",
    "KvEventBatch",
    "Outcome",
    "decode_batch",
]
