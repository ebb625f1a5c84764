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
| TransferNotify, get_notifies                          | Notification, notify / notifications |
|                                                       | (both rows: engine_transfers.py)     |
| batch_transfer_async[...], transfer_submit_write,     | submit, through compat.BatchTable    |
| get_batch_transfer_status, transfer_check_status      | (engine_batches.py)                  |
| send_probe                                            | probe                                |
| get_local_topology                                    | (the NUMA nodes; no RDMA NICs)       |
| InnerTransferEngine (what get_engine() returns)       | tsukimi.transfer.TransferEngine      |

The class is Mooncake's API surface: `initialize` starts tsukimi's engine and hands it to the
parts, which own their state (`LocalMemory`: the managed buffers; `BatchTransfers`: the batch
table; `SyncTransfers`), and every call is delegated to one of them. `close` replaces them
with parts over no engine, whose calls fail as before initialize.

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
from pathlib import Path

from tsukimi.compat.mooncake.engine_batches import BatchTransfers
from tsukimi.compat.mooncake.engine_codes import ERR_INVALID_ARGUMENT, FAILED, OK, failed
from tsukimi.compat.mooncake.engine_memory import LocalMemory
from tsukimi.compat.mooncake.engine_setup import EngineSetup, engine_setup, started
from tsukimi.compat.mooncake.engine_transfers import SyncTransfers, TransferBatch, TransferNotify, TransferOpcode
from tsukimi.errors import TsukimiError
from tsukimi.transfer import TransferEngine as _Engine

__all__ = [
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "InnerTransferEngine",
    "Read",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "Write",
]

logger = logging.getLogger(__name__)

InnerTransferEngine = _Engine  # NOTE: the wheel's name for the C++ engine get_engine() returns
Read = TransferOpcode.Read
Write = TransferOpcode.Write
# NOTE: what Mooncake's wheel was built with; tsukimi moves host memory only
SUPPORT_CUDA = SUPPORT_EFA = SUPPORT_HIP = SUPPORT_INTRA_NVLINK = SUPPORT_MNNVL = SUPPORT_MUSA = False


class TransferEngine:
    """`mooncake.engine.TransferEngine` on tsukimi (see the module). Once initialized, its
    calls may come from several threads; `close()` (not in Mooncake) frees it before the
    process ends."""

    TransferOpcode = TransferOpcode  # NOTE: the wheel binds the enum inside the class too

    def __init__(self) -> None:
        self._attach(None)

    def _attach(self, engine: _Engine | None) -> None:
        """Make the parts over `engine` (None: before initialize, after close). Mutates."""
        self._engine: _Engine | None = engine
        self._memory = LocalMemory(engine)
        self._transfers = SyncTransfers(engine)
        self._batches = BatchTransfers(engine)

    # -- setup ---------------------------------------------------------------------------------

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
        self._attach(engine)
        return OK

    def get_rpc_port(self) -> int:
        """The port of this engine's segment server (in p2p mode, part of its name)."""
        return started(self._engine).describe().endpoints[0].port

    def get_local_hostname(self) -> str:
        """This engine's segment name (not in Mooncake's API)."""
        return started(self._engine).name

    def get_local_topology(self, device_name: str | None = None) -> str:
        """The wheel's topology JSON: per NUMA node `"cpu:N"`, its preferred and other RDMA
        NICs (narrowed to `device_name`'s when given). tsukimi drives none, so both lists are
        empty, as the wheel answers on a host without RDMA NICs; works before initialize."""
        if device_name is not None and not isinstance(device_name, str):
            raise TypeError(f"device_name must be a str or None, got {device_name!r}")
        nodes = sorted(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*")) or [0]
        entries = ",\n".join(f'\t"cpu:{n}" : \n\t[\n\t\t[],\n\t\t[]\n\t]' for n in nodes)
        return "{\n" + entries + "\n}\n"  # NOTE: JsonCpp's styled layout, as the wheel prints it

    def get_engine(self) -> _Engine:
        """The tsukimi TransferEngine underneath (Mooncake returns its C++ engine). Raises
        ConfigError before initialize."""
        return started(self._engine)

    def close(self) -> int:
        """Not in Mooncake's API (its engine lives as long as the process); frees ours."""
        if self._engine is not None:
            self._engine.close()
            self._attach(None)
        return OK

    # -- local memory --------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register [buffer_addr, +capacity) of CPU memory for peers: 0, -1, -7 (overlaps)."""
        return self._memory.register(buffer_addr, capacity, location)

    def unregister_memory(self, buffer_addr: int) -> int:
        """0, or -3 when nothing is registered at `buffer_addr`."""
        return self._memory.unregister(buffer_addr)

    def batch_register_memory(self, buffer_addresses: list[int], capacities: list[int], location: str = "*") -> int:
        """Register each buffer; all or none (the first failure's code)."""
        return self._memory.register_all(buffer_addresses, capacities, location)

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        """Unregister each buffer that is registered; the first failure's code."""
        return self._memory.unregister_all(buffer_addresses)

    def allocate_managed_buffer(self, length: int) -> int:
        """A registered buffer of `length` bytes owned by the engine (shared memory, which
        peers on this host reach without a copy); its address, 0 on failure."""
        return self._memory.allocate(length)

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """0, or -3 when `buffer_addr` is not a managed buffer of this engine."""
        return self._memory.free(buffer_addr)

    def read_bytes_from_buffer(self, buffer_addr: int, length: int) -> bytes:
        """A copy of registered memory. Raises OutOfBounds outside it, ConfigError before initialize."""
        return self._memory.read(buffer_addr, length)

    def write_bytes_to_buffer(self, buffer_addr: int, src_data: bytes | str, length: int) -> int:
        """Copy the first `length` bytes of `src_data` into registered memory: 0, -1 (more
        bytes asked than given), -3 (not registered memory)."""
        return self._memory.write(buffer_addr, src_data, length)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The lowest registered address of segment `segment_name` (fetched anew; this
        engine's own included); 0 when it has none or cannot be found."""
        try:
            buffers = started(self._engine).lookup(segment_name, fresh=True).buffers
        except TsukimiError as exc:
            failed(f"get_first_buffer_address({segment_name})", exc)
            return 0
        return buffers[0].base if buffers else 0

    # -- synchronous transfers, notifications, probes ------------------------------------------

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

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """`batch_transfer_sync` with opcode Write."""
        return self.batch_transfer_sync(
            target_hostname, buffers, peer_buffer_addresses, lengths, Write, transport_hint=transport_hint
        )

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """`batch_transfer_sync` with opcode Read."""
        return self.batch_transfer_sync(
            target_hostname, buffers, peer_buffer_addresses, lengths, Read, transport_hint=transport_hint
        )

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
        batch = TransferBatch(target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint)
        return self._transfers.transfer(batch, notify)

    def get_notifies(self) -> list[TransferNotify]:
        """The notifications peers sent here since the last call, oldest first."""
        return self._transfers.notifies()

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer's engine answers a probe; otherwise a negative code (-200: no such
        segment; -101 / -102: a p2p name that does not resolve / a refused or broken connection)."""
        try:
            started(self._engine).probe(peer_server_name)
        except TsukimiError as exc:
            return failed(f"send_probe({peer_server_name})", exc)
        return OK

    # -- asynchronous transfers (batch ids) ----------------------------------------------------

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: int,
        transport_hint: str = "",
    ) -> int:
        """Start the transfers; their batch id, or 0 when nothing was started (an unknown
        peer, bad arguments, not initialized)."""
        batch = TransferBatch(target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint)
        return self._batches.submit(batch)

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """`batch_transfer_async` with opcode Write."""
        return self.batch_transfer_async(
            target_hostname, buffers, peer_buffer_addresses, lengths, Write, transport_hint=transport_hint
        )

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """`batch_transfer_async` with opcode Read."""
        return self.batch_transfer_async(
            target_hostname, buffers, peer_buffer_addresses, lengths, Read, transport_hint=transport_hint
        )

    def transfer_submit_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, transport_hint: str = ""
    ) -> int:
        """One asynchronous write; its batch id (0 when not started): see transfer_check_status."""
        return self.batch_transfer_async(
            target_hostname, [buffer], [peer_buffer_address], [length], Write, transport_hint
        )

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Wait for every batch (each bounded by its requests' deadline) and free it: 0 when
        every request of every batch completed, -1 otherwise (an unknown id included)."""
        return self._batches.wait(batch_ids)

    def transfer_check_status(self, batch_id: int) -> int:
        """0 while the batch is pending; once it ended (the id is then freed) 1 when every
        request completed, -1 when one failed; -1 for an unknown id."""
        return self._batches.check(batch_id)
