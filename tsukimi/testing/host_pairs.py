"""Engine pairs whose target runs in another process, on another host if that process was
started in one (tsukimi/lab): what the transport conformance suite (`transport_checks`) runs
against between emulated hosts.

    peer = JsonWorker("target", ["tsukimi.testing.target_peer", url], wrapper=lab.command("b", []), ...)
    with lab.entered("a"):                                     the initiator's sockets in host a
        check_transport(host_pair_maker(peer, "tcp-4", url, bind_host=lab.address("a"),
                                        target_host=lab.address("b")))

The target is a `RemoteTarget`: the `PairTarget` calls (allocate, unregister, notifications)
go to the peer (target_peer.py) over its JSON lines; the pair's `buf.view` maps the peer's
shared-memory file, the checks' window on the owner's memory (the hosts share the machine's
/dev/shm: only their networks are apart). The initiator is a TransferEngine in this process,
on the metadata service at `metadata_url` as the peer is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from tsukimi.testing.engine_pairs import TARGET_BYTES, PairMaker, initiator_config
from tsukimi.testing.processes import JsonWorker, Reply
from tsukimi.transfer import Notification, RegisteredBuffer, TransferEngine
from tsukimi.transfer.shared_memory import SharedMapping, map_shared

CALL_TIMEOUT_S = 30.0


class RemoteTarget:
    """The `PairTarget` of a target engine in a target_peer process (see the module).
    Not thread-safe (the checks call it from one thread)."""

    def __init__(self, peer: JsonWorker, shm_dir: str = "/dev/shm") -> None:
        self._peer = peer
        self._shm_dir = shm_dir
        self._mappings: list[SharedMapping] = []

    def open(self, bind_host: str, nbytes: int) -> tuple[Reply, RegisteredBuffer]:
        """Open the peer's engine serving on `bind_host` with `nbytes` of shared memory
        (mutates the peer). Returns its reply (name, host_id) and that buffer, mapped here.
        Raises WorkerError (the peer failed)."""
        reply = self._peer.call(CALL_TIMEOUT_S, cmd="open", bind_host=bind_host, nbytes=nbytes)
        return reply, self._mapped(reply["buffer"])

    def allocate(self, nbytes: int) -> RegisteredBuffer:
        """A new shared-memory buffer of the peer's engine, mapped here. Raises WorkerError."""
        return self._mapped(self._peer.call(CALL_TIMEOUT_S, cmd="allocate", nbytes=nbytes)["buffer"])

    def unregister(self, base: int) -> None:
        """The peer's engine withdraws the buffer at `base`. Raises WorkerError."""
        self._peer.call(CALL_TIMEOUT_S, cmd="unregister", base=base)

    def notifications(self, max_count: int | None = None, timeout_s: float = 0.0) -> list[Notification]:
        """What peers delivered to the peer's engine (see TransferEngine.notifications)."""
        reply = self._peer.call(CALL_TIMEOUT_S + timeout_s, cmd="notifications", max_count=max_count, wait_s=timeout_s)
        return [Notification(name, bytes.fromhex(message)) for name, message in reply["notifications"]]

    def _mapped(self, desc: dict[str, int | str]) -> RegisteredBuffer:
        mapping = map_shared(self._shm_dir, str(desc["shm_name"]))
        self._mappings.append(mapping)
        base, length = int(desc["base"]), int(desc["length"])
        view = mapping.view if len(mapping.view) == length else mapping.view[:length]
        return RegisteredBuffer(base, length, view, mapping, shm_name=mapping.name)

    def close(self) -> None:
        """Close the peer's engine (its buffers go with it) and unmap ours. Idempotent."""
        self._peer.call(CALL_TIMEOUT_S, cmd="close")
        for mapping in self._mappings:
            with contextlib.suppress(BufferError):  # NOTE: a check's numpy view may outlive it
                mapping.close()
        self._mappings.clear()


@dataclass(frozen=True, slots=True)
class HostPair:
    """A `Pair` (engine_pairs.py) whose target is a RemoteTarget."""

    case: str
    target: RemoteTarget
    initiator: TransferEngine
    buf: RegisteredBuffer


@contextlib.contextmanager
def host_pair(
    peer: JsonWorker, case: str, metadata_url: str, bind_host: str, target_host: str, **extra: object
) -> Iterator[HostPair]:
    """A fresh pair under transport setting `case` (engine_pairs.TRANSPORT_CASES, no
    secret): the peer's target serving on `target_host` with TARGET_BYTES, an initiator here
    serving on `bind_host`, `extra` TransferConfig fields on top. Both closed on exit.

    Raises:
        WorkerError: the peer failed. KeyError: an unknown case. OSError: cannot bind.
    """
    target = RemoteTarget(peer)
    try:
        _, buf = target.open(target_host, TARGET_BYTES)
        config = initiator_config(case, metadata_url, None, bind_host=bind_host, **extra)
        with TransferEngine("initiator", config) as initiator:
            yield HostPair(case, target, initiator, buf)
    finally:
        target.close()


def host_pair_maker(
    peer: JsonWorker, case: str, metadata_url: str, bind_host: str, target_host: str, **extra: object
) -> PairMaker:
    """The PairMaker of `host_pair` with these arguments."""
    return lambda: host_pair(peer, case, metadata_url, bind_host, target_host, **extra)
