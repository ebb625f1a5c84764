"""Mooncake's dummy clients on tsukimi: the handshake of `setup_dummy` with the standalone
client (`tsukimi compat mooncake-client`, client_service.py) that holds the store's memory,
and the dummy's own `MemPool`, which serves `alloc_from_mem_pool`.

    mooncake-client process                     application process
    StoreClient, global segment (the memory)    MooncakeDistributedStore.setup_dummy(pool, buf, "h:50052")
    RPC server on --host:--port  <--Hello----   (asks where the store is)
                                 --Welcome-->   StoreClient holding no segment, its TE on this host,
                                                a pool of shared memory for alloc_from_mem_pool

The dummy moves bytes with its own Transfer Engine (shared memory or CMA to the standalone
client on this host), so it needs no RPC per put or get; the standalone client holds the
memory objects live in and stays up while dummies come and go. A dummy has no segment of
its own: `get_hostname()` is "".
"""

from __future__ import annotations

import logging
import os
import threading

import msgspec

from tsukimi.compat.mooncake.setup_args import StoreSetup
from tsukimi.errors import ConfigError
from tsukimi.rpc import Codec, RpcClient
from tsukimi.store.master.allocator import OffsetAllocator
from tsukimi.transfer import RegisteredBuffer, TransferEngine

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0
POOL_ALIGNMENT = 64


class Hello(msgspec.Struct, frozen=True, tag=True):
    """A dummy client introduces itself (its pid, for the standalone client's log)."""

    pid: int


class Welcome(msgspec.Struct, frozen=True, tag=True):
    """Where the store is: the master, the metadata service, the transport to use, and the
    standalone client's own TE segment."""

    master: str
    metadata_url: str
    transport: str
    nixl: bool
    segment: str


CODEC = Codec([Hello], [Welcome])


def hello(server_address: str) -> Welcome:
    """Ask the standalone client at "host:port" where the store is.

    Raises:
        ConfigError: a malformed address. RpcTimeout, BrokenConnectionError: no answer.
    """
    host, sep, port = server_address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"server_address must be host:port, got {server_address!r}")
    with RpcClient(CODEC, f"tcp://{host}:{port}", timeout_s=HELLO_TIMEOUT_S) as rpc:
        return rpc.call_as(Hello(os.getpid()), Welcome)


def dummy_setup(welcome: Welcome, server_address: str, local_buffer_size: int) -> StoreSetup:
    """The setup of a dummy client: no segment, its TE bound on the standalone client's host."""
    host = server_address.rpartition(":")[0].strip("[]")
    return StoreSetup(
        host, 0, welcome.metadata_url, 0, local_buffer_size, welcome.master, welcome.transport, welcome.nixl
    )


class MemPool:
    """`mem_pool_size` bytes of shared memory registered with the dummy's engine, handed
    out by `alloc` (blocks are never given back, as in Mooncake; the pool goes with the
    engine)."""

    def __init__(self, engine: TransferEngine, size: int) -> None:
        self._buffer: RegisteredBuffer = engine.allocate(size)
        self._allocator = OffsetAllocator(size, POOL_ALIGNMENT)
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int:
        """The address of `size` fresh bytes, or 0 when the pool has no room (logged).
        Mutates: the bytes are the caller's for the pool's life."""
        offset = None
        if size > 0:
            with self._lock:
                offset = self._allocator.allocate(size)
        if offset is None:
            logger.error("alloc_from_mem_pool: no room for %d bytes", size)
            return 0
        return self._buffer.base + offset
