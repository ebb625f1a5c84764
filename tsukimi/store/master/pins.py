"""Soft pins with a lifetime: when an object's soft pin ends, and what a new version of a key
inherits from the old one (`ReplicaConfig.keep_soft_pin`).

A soft-pinned object is evicted only after every unpinned one (state.py, `_evict`), and only
until its pin ends: `soft_pin_until`, set when the version is completed (put_end) to now +
its TTL (`ReplicaConfig.soft_pin_ttl_s`, or the master's `soft_pin_ttl_s`). An upsert with
`keep_soft_pin` takes the old version's pin and its end as they are.

Pure functions over the master's object records; the HA log keeps the resolved config, and
a restored record's pin runs until it is replaced (conservative: `soft_pin_until` = inf).
"""

from __future__ import annotations

import math
from typing import Protocol

import msgspec

from tsukimi.store.protocol import ReplicaConfig

FOREVER = math.inf


class ObjectRecord(Protocol):
    """What a pin needs of the master's object record (state.py's `ObjectRecord`)."""

    config: ReplicaConfig
    soft_pin_until: float


def soft_pinned(record: ObjectRecord, now: float) -> bool:
    """Whether the object is soft-pinned at `now` (pure)."""
    return record.config.soft_pin and now < record.soft_pin_until


def settle(record: ObjectRecord, old: ObjectRecord | None, now: float, default_ttl_s: float) -> None:
    """Fix the soft pin of `record`, the version being completed, replacing `old` (None: a
    new key). Mutates `record`: a kept pin becomes the old one's, so the config logged is
    the pin in force."""
    config = record.config
    if config.keep_soft_pin:
        if old is not None and old.config.soft_pin:
            record.config = msgspec.structs.replace(
                config, soft_pin=True, keep_soft_pin=False, soft_pin_ttl_s=old.config.soft_pin_ttl_s
            )
            record.soft_pin_until = old.soft_pin_until
        else:
            record.config = msgspec.structs.replace(config, keep_soft_pin=False)
    elif config.soft_pin:
        ttl_s = default_ttl_s if config.soft_pin_ttl_s is None else config.soft_pin_ttl_s
        record.soft_pin_until = now + ttl_s
