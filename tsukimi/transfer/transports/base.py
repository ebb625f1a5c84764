"""What a transport is, and the registry through which transports join the engine.

A transport is small on purpose: `can_serve` says whether it can reach a given buffer of a
given peer, `submit` starts slices and returns (or finishes them inline when that is cheaper),
and every slice ends by calling `record.slice_done` or `record.slice_failed` exactly once,
before its deadline plus the transport's I/O timeout.

Transports register themselves (`register_transport`) with a factory and a rank; the engine
builds every registered transport that its settings enable and, for `transport="auto"`, gives
a request to the first one, by rank, that can serve it. A new transport joins by registering;
nothing else changes. An optional transport (one whose library is not installed by default,
like NIXL) is named in OPTIONAL and imported only when a configuration enables it.

A transport that must know the local memory (to register it with its library, as NIXL
does) or publish something for peers (its own connection metadata) also implements
`SegmentAware`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from tsukimi.clock import Clock
from tsukimi.config import TransferConfig
from tsukimi.device import DeviceRange
from tsukimi.errors import ConfigError
from tsukimi.transfer.batch import OpCode, RequestRecord
from tsukimi.transfer.segment import BufferDescriptor, RegisteredBuffer, SegmentDescriptor


@dataclass(slots=True)
class Slice:
    """One contiguous piece of a request: `local` is exactly its bytes on this side, or, when
    they are device memory, `device` is (and `local` is empty: the host cannot address them).
    Only transports that take device memory (`device_local = "direct"`) see such slices."""

    record: RequestRecord
    op: OpCode
    local: memoryview
    remote_offset: int
    buffer: BufferDescriptor
    attempts: int = 0
    device: DeviceRange | None = None

    @property
    def nbytes(self) -> int:
        return len(self.local) if self.device is None else self.device.length


DeviceLocal = Literal["direct", "staged", "refuse"]
"""What a transport does with a request whose local buffer is device memory: "direct" takes
its slices (`Slice.device`) and copies with the device's backend; "staged" (the default for a
transport that does not say) moves host bytes only, so the engine stages the device bytes
through pinned host chunks around it (tsukimi/transfer/transports/staged.py); "refuse" cannot
serve it at all (auto picks another transport)."""


class Transport(Protocol):
    name: str
    slice_bytes: int  # requests are cut into slices of at most this many bytes
    # NOTE: optional (read with getattr, default "staged"): see DeviceLocal
    # device_local: DeviceLocal

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        """Whether this transport can reach `buffer` of `peer` from this process."""
        ...

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        """Start the slices. Raises ClosedError only when none of them was started (the
        caller then ends them); after that, every slice ends through its record."""
        ...

    def close(self) -> None:
        """Stop workers; pending slices fail with a ClosedError reason."""
        ...


PreparedItem = tuple[OpCode, memoryview, int]  # what, the local bytes, the remote offset


@runtime_checkable
class Preparable(Protocol):
    """A transport with a fast path for requests run many times (tsukimi/transfer/prepared.py).

    A transport whose prepared call waits on the network (tcp) says so with a class
    attribute `prepared_waits = True` (read with getattr, default False): `transfer()` takes
    that call, `submit()`, which must not wait, never does."""

    def prepare(self, peer: SegmentDescriptor, items: list[PreparedItem]) -> Callable[[float], bool] | None:
        """A call that moves every item at once, within the seconds it is given, and says
        whether all of them completed (False, also when the time ran out: the engine redoes
        them the ordinary way, to learn which failed and why);
        None when this transport cannot prepare them. The caller keeps the buffers alive."""
        ...


@runtime_checkable
class Waitable(Protocol):
    """A transport that can do a waiting caller's part of its slices on the caller's thread
    (tcp: the caller reads the answers to its own small burst, with no hand-off to the
    connection's receiver thread and back). The engine calls it from `transfer()`, which
    waits next, never from `submit()`, which must return at once."""

    def submit_waiting(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        """`submit`, from a caller that waits for these slices next: it may block this thread
        until they end (each within its deadline plus the transport's I/O tick), or return
        earlier and leave the rest to the transport's threads; otherwise as `submit`."""
        ...


@runtime_checkable
class SegmentAware(Protocol):
    """A transport that follows the local segment's registrations and publishes metadata."""

    def on_register(self, buffer: RegisteredBuffer) -> None:
        """`buffer` was just registered locally (before peers are told). Raises TsukimiError
        when the transport cannot take it (the registration is then undone)."""
        ...

    def on_unregister(self, buffer: RegisteredBuffer) -> None:
        """`buffer` was just withdrawn locally."""
        ...

    def local_info(self) -> bytes:
        """What peers need from this side, published in the descriptor's transport_info."""
        ...


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What the engine hands every transport factory.

    host_id: this host's identity (same-host transports compare it with the peer's).
    secret: the cluster secret every connection must prove (None: none).
    on_stale: tell the engine that a peer's cached descriptor is stale (re-fetch it).
    fetch: fetch a peer's current descriptor now, by name (updates the engine's cache; may
        wait on the metadata service; raises its errors).
    version_address: where this process keeps its registration version (a uint64).
    """

    config: TransferConfig
    clock: Clock
    host_id: str
    secret: bytes | None
    on_stale: Callable[[str], None]
    fetch: Callable[[str], SegmentDescriptor]
    version_address: int = 0


TransportFactory = Callable[[TransportContext], Transport]


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    rank: int
    factory: TransportFactory
    enabled: Callable[[TransferConfig], bool]


_REGISTRY: dict[str, _Entry] = {}
# NOTE: transports whose library is not installed by default: imported (and so registered)
# only when a configuration turns them on.
OPTIONAL: dict[str, tuple[str, Callable[[TransferConfig], bool], str]] = {
    "nixl": ("tsukimi.transfer.transports.nixl", lambda config: config.nixl, "make nixl"),
}


def register_transport(
    name: str, factory: TransportFactory, rank: int, enabled: Callable[[TransferConfig], bool] = lambda _: True
) -> None:
    """Make transport `name` available to every engine created from now on whose settings it
    is `enabled` by; `auto` tries transports by ascending `rank` (mutates the registry;
    re-registering a name replaces it).

    Raises:
        ConfigError: `name` is empty or "auto".
    """
    if not name or name == "auto":
        raise ConfigError(f"a transport needs a name other than 'auto', got {name!r}")
    _REGISTRY[name] = _Entry(name, rank, factory, enabled)


def transport_names() -> tuple[str, ...]:
    """The registered transports, in the order `auto` tries them."""
    return tuple(entry.name for entry in sorted(_REGISTRY.values(), key=lambda e: e.rank))


def build_transports(context: TransportContext) -> list[Transport]:
    """One instance of every registered transport `context.config` enables, in the order
    `auto` tries them (importing the optional ones it turns on).

    Raises:
        ConfigError: an optional transport is turned on but its library is not installed, or
            `config.transport` is neither "auto" nor one of them.
    """
    for name, (module, enabled, install) in OPTIONAL.items():
        if enabled(context.config) and name not in _REGISTRY:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(
                    f"transfer.{name} is on but {name} cannot be loaded ({exc}): run `{install}`"
                ) from exc
    entries = sorted(_REGISTRY.values(), key=lambda e: e.rank)
    transports = [entry.factory(context) for entry in entries if entry.enabled(context.config)]
    names = ("auto", *(t.name for t in transports))
    if context.config.transport not in names:
        for transport in transports:
            transport.close()
        raise ConfigError(f"transfer.transport must be one of {', '.join(names)}, got {context.config.transport!r}")
    return transports
