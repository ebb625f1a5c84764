"""`ObjectRecord`: what the master keeps of one object (one version of a key): its replicas,
its disk copies, its lease and put."""

from __future__ import annotations

from dataclasses import dataclass, field

from tsukimi.store.master import pins
from tsukimi.store.master.segments import Placement
from tsukimi.store.protocol import ReplicaConfig


@dataclass(slots=True)
class ObjectRecord:
    key: str
    size: int
    config: ReplicaConfig
    replicas: list[Placement]
    writer: str
    put_deadline: float  # pending objects only
    lease_until: float = 0.0
    put_id: int = 0
    checksum: int | None = None
    soft_pin_until: float = pins.FOREVER  # see pins.py
    disks: list[str] = field(default_factory=list)  # disks holding a copy of this version
    disk_hits: int = 0  # gets while only on disk (promotion admission)
