"""`mooncake.engine` on tsukimi: Mooncake's Transfer Engine API (`TransferEngine`,
`TransferOpcode` with its values `Read` and `Write`, `TransferNotify`) mapped onto tsukimi's
TransferEngine, which does the work:

| Mooncake                                              | tsukimi.transfer.TransferEngine      |
|-------------------------------------------------------|--------------------------------------|
| initialize / initialize_ext                           | TransferEngine(name, config)         |
|                                                       | (engine_setup.py)                    |
| register_memory / unregister_memory (and batch_*)     | register((address, n)) / unregister  |
| allocate_managed_buffer / free_managed_buffer         | allocate(n) / unregister             |
| read_bytes_from_buffer / write_bytes_to_buffer        | local_view(address, n)               |
|                                                       | (those three rows: engine_memory.py) |
| get_first_buffer_address                              | lookup(name, fresh=True)             |
| transfer_sync[_read/_write], batch_transfer_sync[...] | transfer(requests), then notify      |
| batch_transfer_async[...], transfer_submit_write,     | submit, through compat.BatchTable    |
| get_batch_transfer_status, transfer_check_status      | (engine_batches.py)                  |
| send_probe                                            | probe                                |
| TransferNotify, get_notifies                          | Notification, notify / notifications |

Return conventions are Mooncake's: 0 or a negative code (engine_codes.py), a batch id (0 on
failure) from an asynchronous submit, addresses as ints (0 on failure). Where tsukimi differs:
read/write_bytes_*_buffer reach registered memory only (Mooncake copies at any address); a
managed buffer is registered by itself (Mooncake carves it from a registered pool), so
get_first_buffer_address gives the segment's lowest registered address; initialize runs once
per object (a second call returns -1); free_managed_buffer of an unknown address returns -3.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tsukimi.compat.batches import BatchTable
from tsukimi.compat.mooncake.engine_batches import BatchTransfers, TransferOpcode, build_requests, with_opcode
from tsukimi.compat.mooncake.engine_codes import ERR_INVALID_ARGUMENT, FAILED, OK, failed
from tsukimi.compat.mooncake.engine_memory import LocalMemory
from tsukimi.compat.mooncake.engine_setup import EngineSetup, engine_setup
from tsukimi.errors import TsukimiError
from tsukimi.transfer import Notification, RegisteredBuffer, first_error
from tsukimi.transfer import TransferEngine as _Engine

__all__ = [
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "Read",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "Write",
]

logger = logging.getLogger(__name__)

Read = TransferOpcode.Read
Write = TransferOpcode.Write
# NOTE: what Mooncake's wheel was built with; tsukimi moves host memory only
SUPPORT_CUDA = SUPPORT_EFA = SUPPORT_HIP = SUPPORT_INTRA_NVLINK = SUPPORT_MNNVL = SUPPORT_MUSA = False


class TransferNotify:
    """A notification sent with a transfer (`transfer_sync(..., notify=)`) and what
    `get_notifies` returns: `name` and `msg`, strings (bytes are taken as UTF-8)."""

    __slots__ = ("msg", "name")

    def __init__(self, name: str | bytes = "", msg: str | bytes = "") -> None:
        self.name = _text(name)
        self.msg = _text(msg)

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)

    __hash__ = None  # type: ignore[assignment]  # mutable, like Mooncake's


def _text(value: str | bytes) -> str:
    # NOTE: surrogateescape: bytes that are not UTF-8 still round-trip through a notification
    return value if isinstance(value, str) else value.decode("utf-8", "surrogateescape")


class TransferEngine(LocalMemory, BatchTransfers):
    """`mooncake.engine.TransferEngine` on tsukimi (see the module). Once initialized, its
    calls may come from several threads; `close()` (not in Mooncake) frees it before the
    process ends."""

    def __init__(self) -> None:
        self._engine: _Engine | None = None
        self._batches: BatchTable | None = None
        self._managed: dict[int, RegisteredBuffer] = {}

    # -- setup -------------------------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Start the engine: 0, or -1 (bad arguments, no metadata server, already initialized)."""
        return self._start(lambda: engine_setup(local_hostname, metadata_server, protocol))

    def initialize_ext(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, metadata_type: str
    ) -> int:
        """`initialize`, with the metadata server's type when `metadata_server` has no scheme."""
        return self._start(lambda: engine_setup(local_hostname, metadata_server, protocol, metadata_type))

    def _start(self, setup: Callable[[], EngineSetup]) -> int:
        if self._engine is not None:
            logger.error("initialize: this TransferEngine is already initialized")
            return ERR_INVALID_ARGUMENT
        try:
            made = setup()
            engine = _Engine(made.name, made.config)
        except TsukimiError as exc:
            return failed("initialize", exc, FAILED)
        except OSError as exc:  # the segment server cannot bind
            logger.error("initialize failed: %s", exc)
            return FAILED
        self._engine, self._batches = engine, BatchTable(engine)
        return OK

    def get_rpc_port(self) -> int:
        """The port of this engine's segment server (in p2p mode, part of its name)."""
        return self._require().describe().endpoints[0].port

    def get_local_hostname(self) -> str:
        """This engine's segment name (not in Mooncake's API)."""
        return self._require().name

    def get_engine(self) -> _Engine:
        """The tsukimi TransferEngine underneath (Mooncake returns its C++ engine)."""
        return self._require()

    def close(self) -> int:
        """Not in Mooncake's API (its engine lives as long as the process); frees ours."""
        if self._engine is not None:
            self._engine.close()
            self._engine, self._batches = None, None
            self._managed.clear()
        return OK

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The lowest registered address of segment `segment_name` (fetched anew; this
        engine's own included); 0 when it has none or cannot be found."""
        try:
            buffers = self._require().lookup(segment_name, fresh=True).buffers
        except TsukimiError as exc:
            failed(f"get_first_buffer_address({segment_name})", exc)
            return 0
        return buffers[0].base if buffers else 0

    # -- synchronous transfers, notifications, probes -----------------------------------------

    def transfer_sync_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length, Write, None, transport_hint)

    def transfer_sync_read(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length, Read, None, transport_hint)

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: int,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """One transfer, then (when it completed) `notify` delivered to the peer: 0 or -1."""
        return self.batch_transfer_sync(
            target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify, transport_hint
        )

    batch_transfer_sync_write = with_opcode("batch_transfer_sync", TransferOpcode.Write)

    batch_transfer_sync_read = with_opcode("batch_transfer_sync", TransferOpcode.Read)

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: int,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """Every transfer, waited for (each bounded by transfer.timeout_s), then `notify`: 0
        when all completed and the notification (if any) was delivered, -1 otherwise."""
        try:
            engine = self._require()
            requests = build_requests(
                engine, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint
            )
            error = first_error(engine.transfer(requests))
            if error is not None:
                raise error
            if notify is not None:
                engine.notify(target_hostname, Notification(notify.name, notify.msg.encode("utf-8", "surrogateescape")))
        except TsukimiError as exc:
            return failed(f"transfer to {target_hostname}", exc, FAILED)
        return OK

    def get_notifies(self) -> list[TransferNotify]:
        """The notifications peers sent here since the last call, oldest first."""
        taken = self._require().notifications()
        return [TransferNotify(n.name, n.message) for n in taken]

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer's engine answers a probe; otherwise a negative code (-200: no such
        segment; -101 / -102: a p2p name that does not resolve / a refused or broken connection)."""
        try:
            self._require().probe(peer_server_name)
        except TsukimiError as exc:
            return failed(f"send_probe({peer_server_name})", exc)
        return OK
