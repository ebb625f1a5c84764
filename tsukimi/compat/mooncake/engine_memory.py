"""The local-memory half of `mooncake.engine.TransferEngine`: registering memory for peers,
managed buffers, and copying bytes in and out of registered memory, over tsukimi's
`TransferEngine.register / unregister / allocate / local_view`.

Unlike Mooncake, read_bytes_from_buffer and write_bytes_to_buffer reach registered memory only
(Mooncake copies at any address: here a wrong address is an error, not a crash), and a managed
buffer is registered by itself (Mooncake carves them from one registered pool).
"""

from __future__ import annotations

import logging

from tsukimi.compat.mooncake.engine_codes import (
    ERR_ADDRESS_NOT_REGISTERED,
    ERR_ADDRESS_OVERLAPPED,
    FAILED,
    OK,
    failed,
)
from tsukimi.errors import ConfigError, InvalidArgument, OutOfBounds, TsukimiError
from tsukimi.transfer import RegisteredBuffer
from tsukimi.transfer import TransferEngine as _Engine

logger = logging.getLogger(__name__)


class LocalMemory:
    """Mixin of the facade's TransferEngine: `_engine` is set by initialize, `_managed` holds
    the managed buffers it allocated (by address)."""

    _engine: _Engine | None
    _managed: dict[int, RegisteredBuffer]

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register [buffer_addr, +capacity) of CPU memory for peers: 0, -1, -7 (overlaps)."""
        try:
            engine = self._require()
            if buffer_addr <= 0 or capacity <= 0 or not (location == "*" or location.startswith("cpu")):
                raise InvalidArgument(f"cannot register {capacity} bytes at {buffer_addr:#x} on {location!r}")
            end = buffer_addr + capacity
            if any(b.base < end and buffer_addr < b.base + b.length for b in engine.describe().buffers):
                return failed("register_memory", InvalidArgument("overlaps registered memory"), ERR_ADDRESS_OVERLAPPED)
            engine.register((buffer_addr, capacity))
        except TsukimiError as exc:
            return failed("register_memory", exc, FAILED)
        return OK

    def unregister_memory(self, buffer_addr: int) -> int:
        """0, or -3 when nothing is registered at `buffer_addr`."""
        try:
            self._require().unregister(buffer_addr)
        except OutOfBounds as exc:
            return failed("unregister_memory", exc, ERR_ADDRESS_NOT_REGISTERED)
        except TsukimiError as exc:
            return failed("unregister_memory", exc, FAILED)
        self._managed.pop(buffer_addr, None)
        return OK

    def batch_register_memory(self, buffer_addresses: list[int], capacities: list[int], location: str = "*") -> int:
        """Register each buffer; all or none (the first failure's code)."""
        if len(buffer_addresses) != len(capacities):
            return failed("batch_register_memory", InvalidArgument("lists of different lengths"), FAILED)
        for i, (address, capacity) in enumerate(zip(buffer_addresses, capacities, strict=True)):
            code = self.register_memory(address, capacity, location)
            if code != OK:
                for done in buffer_addresses[:i]:
                    self.unregister_memory(done)
                return code
        return OK

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        """Unregister each buffer that is registered; the first failure's code."""
        codes = [self.unregister_memory(address) for address in buffer_addresses]
        return next((code for code in codes if code != OK), OK)

    def allocate_managed_buffer(self, length: int) -> int:
        """A registered buffer of `length` bytes owned by the engine (shared memory, which
        peers on this host reach without a copy); its address, 0 on failure."""
        try:
            buf = self._require().allocate(length)
        except (TsukimiError, OSError) as exc:
            logger.error("allocate_managed_buffer(%d) failed: %s", length, exc)
            return 0
        self._managed[buf.base] = buf
        return buf.base

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """0, or -3 when `buffer_addr` is not a managed buffer of this engine."""
        if buffer_addr not in self._managed:
            return failed(
                "free_managed_buffer", OutOfBounds(f"no managed buffer at {buffer_addr:#x}"), ERR_ADDRESS_NOT_REGISTERED
            )
        return self.unregister_memory(buffer_addr)

    def read_bytes_from_buffer(self, buffer_addr: int, length: int) -> bytes:
        """A copy of registered memory. Raises OutOfBounds outside it, ConfigError before initialize."""
        return bytes(self._require().local_view(buffer_addr, length))

    def write_bytes_to_buffer(self, buffer_addr: int, src_data: bytes | str, length: int) -> int:
        """Copy the first `length` bytes of `src_data` into registered memory: 0, -1 (more
        bytes asked than given), -3 (not registered memory)."""
        data = src_data.encode() if isinstance(src_data, str) else bytes(src_data)
        try:
            if not 0 <= length <= len(data):
                raise InvalidArgument(f"length {length} for {len(data)} bytes of data")
            if length:
                self._require().local_view(buffer_addr, length)[:] = data[:length]
        except OutOfBounds as exc:
            return failed("write_bytes_to_buffer", exc, ERR_ADDRESS_NOT_REGISTERED)
        except TsukimiError as exc:
            return failed("write_bytes_to_buffer", exc, FAILED)
        return OK

    def _require(self) -> _Engine:
        if self._engine is None:
            raise ConfigError("TransferEngine: call initialize() first")
        return self._engine
