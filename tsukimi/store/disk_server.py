"""Reading disk copies: a holder's disk server (`DiskServer`, over its `DiskStore`) and a
reader's connections to them (`DiskReader`).

A reader reads a version in chunks of at most MAX_READ_BYTES (`ReadDisk`), each call bounded
by a timeout, then checks the whole value's crc32c against the one each reply carries. A copy
is named by its version (put id), so a read can fail (the copy was deleted) but never return
another version's bytes.
"""

from __future__ import annotations

import logging
import threading

import crc32c
import msgspec

from tsukimi.errors import ChecksumMismatch, InvalidArgument, TransferError, TsukimiError
from tsukimi.rpc import NO_RETRY, RpcClient, RpcServer
from tsukimi.store.disk import DiskStore
from tsukimi.store.disk_protocol import DISK_CODEC, MAX_READ_BYTES, DiskData, DiskLocation, ReadDisk

logger = logging.getLogger(__name__)


class DiskServer:
    """Serves `store`'s files to readers until `close()`."""

    def __init__(self, store: DiskStore, host: str, secret: bytes | None = None) -> None:
        """Raises ConfigError if `host` cannot be bound."""
        self._store = store
        self.num_reads = 0
        self.rpc = RpcServer(DISK_CODEC, self._handle, bind=f"tcp://{host}:0", name="disk", secret=secret)

    @property
    def endpoint(self) -> str:
        return self.rpc.endpoint

    def _handle(self, request: msgspec.Struct) -> msgspec.Struct:
        if not isinstance(request, ReadDisk):
            raise InvalidArgument(f"a disk server does not handle {type(request).__name__}")
        if not 0 < request.length <= MAX_READ_BYTES or request.offset < 0:
            raise InvalidArgument(f"a disk read is 1..{MAX_READ_BYTES} bytes at an offset >= 0, got {request}")
        data = bytearray(request.length)
        _, crc = self._store.read_into(request.key, request.put_id, request.offset, memoryview(data))
        self.num_reads += 1
        return DiskData(bytes(data), crc)

    def close(self) -> None:
        self.rpc.close()


class DiskReader:
    """A client's connections to holders' disk servers, one per endpoint. Thread-safe."""

    def __init__(self, timeout_s: float, secret: bytes | None = None) -> None:
        self._timeout_s = timeout_s
        self._secret = secret
        self._lock = threading.Lock()
        self._clients: dict[str, RpcClient] = {}
        self.num_reads = 0  # objects read from a disk (Mooncake's offload RPC read count)

    def read(self, key: str, copies: list[DiskLocation], dest: memoryview) -> TsukimiError | None:
        """Read `key` from the first copy that answers into `dest` (exactly its size); None
        on success, else the error of the last copy tried (a TransferError or ChecksumMismatch)."""
        error: TsukimiError | None = None
        for copy in copies:
            try:
                self._read_one(key, copy, dest)
            except TsukimiError as exc:
                logger.warning("reading %r from disk %s failed: %s", key, copy.disk_id, exc)
                error = exc if isinstance(exc, ChecksumMismatch) else TransferError(f"disk copy of {key!r}: {exc}")
                error.__cause__ = exc
                continue
            with self._lock:
                self.num_reads += 1
            return None
        return error or TransferError(f"{key!r} has no disk copy")

    def _read_one(self, key: str, copy: DiskLocation, dest: memoryview) -> None:
        client = self._client(copy.endpoint)
        crc, offset, expected = 0, 0, None
        while offset < copy.size:
            length = min(MAX_READ_BYTES, copy.size - offset)
            reply = client.call_as(ReadDisk(key, copy.put_id, offset, length), DiskData, self._timeout_s)
            if len(reply.data) != length:
                raise TransferError(f"disk {copy.disk_id} sent {len(reply.data)} bytes for {length}")
            dest[offset : offset + length] = reply.data
            crc = crc32c.crc32c(reply.data, crc)
            expected, offset = reply.checksum, offset + length
        if crc != expected:
            raise ChecksumMismatch(f"the copy of {key!r} on disk {copy.disk_id} does not match its crc32c")

    def _client(self, endpoint: str) -> RpcClient:
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                client = RpcClient(DISK_CODEC, endpoint, self._timeout_s, secret=self._secret, retry=NO_RETRY)
                self._clients[endpoint] = client
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
