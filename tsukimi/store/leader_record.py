"""Where an HA store master's leader is published: the record a leader writes under
`leader_key` in etcd, and clients (master_link.py) read to find it. Kept apart from the
HA package so a client does not import the master's side."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from tsukimi.errors import ProtocolError


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """What an HA leader publishes under `leader_key` and clients read to find it."""

    rpc: str
    http: str
    name: str
    pid: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> LeaderInfo:
        """Raises ProtocolError on a malformed value."""
        try:
            fields = json.loads(data)
            return cls(str(fields["rpc"]), str(fields["http"]), str(fields["name"]), int(fields.get("pid", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed leader record in etcd: {exc}") from exc


def leader_key(cluster: str) -> bytes:
    """The etcd key of the HA group `cluster`'s leader record."""
    return f"/tsukimi/{cluster}/leader".encode()
