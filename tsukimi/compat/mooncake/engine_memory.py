"""The local-memory part of `mooncake.engine.TransferEngine` (`LocalMemory`): registering
memory for peers, managed buffers, and copying bytes in and out of registered memory, over
tsukimi's `TransferEngine.register / unregister / allocate / local_view`.

Memory is registered where it lives: `location` "*" finds out (host memory, or a GPU's: a device
pointer from torch or cupy, as SGLang and vLLM's MooncakeConnector pass), "cpu:N" says host
memory, "cuda:N" device memory (tsukimi/transfer/device_memory.py).

Unlike Mooncake, read_bytes_from_buffer and write_bytes_to_buffer reach registered memory only
(Mooncake copies at any address: here a wrong address is an error, not a crash), device memory
included (copied through its device); and a managed buffer is registered by itself (Mooncake
carves them from one registered pool).
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
from tsukimi.compat.mooncake.engine_setup import started
from tsukimi.device import DeviceRange, backend
from tsukimi.errors import InvalidArgument, OutOfBounds, TsukimiError
from tsukimi.transfer import RegisteredBuffer, TransferEngine

logger = logging.getLogger(__name__)


class LocalMemory:
    """This process's memory as the engine `initialize` started sees it (None: every call
    fails as Mooncake's uninitialized engine does), and the managed buffers it allocated (by
    address; they go with this part, which the facade replaces at close)."""

    def __init__(self, engine: TransferEngine | None) -> None:
        self._engine = engine
        self._managed: dict[int, RegisteredBuffer] = {}

    def register(self, buffer_addr: int, capacity: int, location: str) -> int:
        """Register [buffer_addr, +capacity) of host or device memory for peers (`location`:
        "*" finds out, "cpu:N", "cuda:N"): 0, -1, -7 (overlaps)."""
        try:
            engine = started(self._engine)
            if buffer_addr <= 0 or capacity <= 0 or not location:
                raise InvalidArgument(f"cannot register {capacity} bytes at {buffer_addr:#x} on {location!r}")
            end = buffer_addr + capacity
            if any(b.base < end and buffer_addr < b.base + b.length for b in engine.describe().buffers):
                return failed("register_memory", InvalidArgument("overlaps registered memory"), ERR_ADDRESS_OVERLAPPED)
            engine.register((buffer_addr, capacity), location=location)
        except TsukimiError as exc:
            return failed("register_memory", exc, FAILED)
        return OK

    def unregister(self, buffer_addr: int) -> int:
        """0, or -3 when nothing is registered at `buffer_addr`."""
        try:
            started(self._engine).unregister(buffer_addr)
        except OutOfBounds as exc:
            return failed("unregister_memory", exc, ERR_ADDRESS_NOT_REGISTERED)
        except TsukimiError as exc:
            return failed("unregister_memory", exc, FAILED)
        self._managed.pop(buffer_addr, None)
        return OK

    def register_all(self, buffer_addresses: list[int], capacities: list[int], location: str) -> int:
        """Register each buffer; all or none (the first failure's code)."""
        if len(buffer_addresses) != len(capacities):
            return failed("batch_register_memory", InvalidArgument("lists of different lengths"), FAILED)
        for i, (address, capacity) in enumerate(zip(buffer_addresses, capacities, strict=True)):
            code = self.register(address, capacity, location)
            if code != OK:
                for done in buffer_addresses[:i]:
                    self.unregister(done)
                return code
        return OK

    def unregister_all(self, buffer_addresses: list[int]) -> int:
        """Unregister each buffer that is registered; the first failure's code."""
        codes = [self.unregister(address) for address in buffer_addresses]
        return next((code for code in codes if code != OK), OK)

    def allocate(self, length: int) -> int:
        """A registered buffer of `length` bytes owned by the engine (shared memory, which
        peers on this host reach without a copy); its address, 0 on failure."""
        try:
            buf = started(self._engine).allocate(length)
        except (TsukimiError, OSError) as exc:
            logger.error("allocate_managed_buffer(%d) failed: %s", length, exc)
            return 0
        self._managed[buf.base] = buf
        return buf.base

    def free(self, buffer_addr: int) -> int:
        """0, or -3 when `buffer_addr` is not a managed buffer of this engine."""
        if buffer_addr not in self._managed:
            return failed(
                "free_managed_buffer", OutOfBounds(f"no managed buffer at {buffer_addr:#x}"), ERR_ADDRESS_NOT_REGISTERED
            )
        return self.unregister(buffer_addr)

    def read(self, buffer_addr: int, length: int) -> bytes:
        """A copy of registered memory. Raises OutOfBounds outside it, ConfigError before initialize."""
        memory = started(self._engine).local_memory(buffer_addr, length)
        if isinstance(memory, DeviceRange):
            out = bytearray(length)
            backend(memory.device).to_host(memory, memoryview(out))
            return bytes(out)
        return bytes(memory)

    def write(self, buffer_addr: int, src_data: bytes | str, length: int) -> int:
        """Copy the first `length` bytes of `src_data` into registered memory: 0, -1 (more
        bytes asked than given), -3 (not registered memory)."""
        data = src_data.encode() if isinstance(src_data, str) else bytes(src_data)
        try:
            if not 0 <= length <= len(data):
                raise InvalidArgument(f"length {length} for {len(data)} bytes of data")
            if length:
                memory = started(self._engine).local_memory(buffer_addr, length)
                if isinstance(memory, DeviceRange):
                    backend(memory.device).from_host(memory, memoryview(data)[:length])
                else:
                    memory[:] = data[:length]
        except OutOfBounds as exc:
            return failed("write_bytes_to_buffer", exc, ERR_ADDRESS_NOT_REGISTERED)
        except TsukimiError as exc:
            return failed("write_bytes_to_buffer", exc, FAILED)
        return OK
