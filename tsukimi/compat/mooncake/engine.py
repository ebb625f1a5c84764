"""`mooncake.engine` on tsukimi: Mooncake's `TransferEngine` over tsukimi's Transfer Engine
(p2p handshake or a metadata server; segment names are host:port, as Mooncake's P2P mode)."""

from __future__ import annotations

import logging
from dataclasses import replace

from tsukimi.compat.mooncake.codes import OK
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError, TsukimiError
from tsukimi.transfer import OpCode, RegisteredBuffer, TransferRequest, first_error
from tsukimi.transfer import TransferEngine as _Engine

logger = logging.getLogger(__name__)


class TransferEngine:
    """`mooncake.engine.TransferEngine` on tsukimi's Transfer Engine (p2p handshake or a
    metadata server; segment names are host:port, as Mooncake's P2P mode)."""

    def __init__(self) -> None:
        self._engine: _Engine | None = None
        self._managed: dict[int, RegisteredBuffer] = {}

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        url = "p2p" if metadata_server.upper() in ("P2PHANDSHAKE", "") else metadata_server
        try:
            host = local_hostname.rsplit(":", 1)[0] if local_hostname else "127.0.0.1"
            config = replace(Config(), transfer=TransferConfig(bind_host=host), metadata=MetadataConfig(url=url))
            self._engine = _Engine(None if url == "p2p" else local_hostname, config)
        except (TsukimiError, OSError) as exc:
            logger.error("initialize failed: %s", exc)
            return -1
        return OK

    def get_rpc_port(self) -> int:
        return self._require().describe().endpoints[0].port

    def get_local_hostname(self) -> str:
        return self._require().name

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        try:
            self._require().register((buffer_addr, capacity))
        except TsukimiError as exc:
            logger.error("register_memory failed: %s", exc)
            return -1
        return OK

    def unregister_memory(self, buffer_addr: int) -> int:
        try:
            self._require().unregister(buffer_addr)
        except TsukimiError:
            return -1
        return OK

    def allocate_managed_buffer(self, length: int) -> int:
        """A registered buffer owned by the engine; returns its address (0 on failure)."""
        buf = self._require().allocate(length)
        self._managed[buf.base] = buf
        return buf.base

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        if self._managed.pop(buffer_addr, None) is None:
            return -1
        self._require().unregister(buffer_addr)
        return OK

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return self.batch_transfer_sync_write(target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return self.batch_transfer_sync_read(target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(
        self, target: str, buffers: list[int], peer_addrs: list[int], lengths: list[int]
    ) -> int:
        return self._batch(target, buffers, peer_addrs, lengths, write=True)

    def batch_transfer_sync_read(
        self, target: str, buffers: list[int], peer_addrs: list[int], lengths: list[int]
    ) -> int:
        return self._batch(target, buffers, peer_addrs, lengths, write=False)

    def _batch(self, target: str, buffers: list[int], peer_addrs: list[int], lengths: list[int], write: bool) -> int:
        engine = self._require()
        op = OpCode.WRITE if write else OpCode.READ
        requests = [
            TransferRequest(op, target, peer, (local, n))
            for local, peer, n in zip(buffers, peer_addrs, lengths, strict=True)
        ]
        try:
            error = first_error(engine.transfer(requests))
            if error is not None:
                raise error
        except TsukimiError as exc:
            logger.error("transfer to %s failed: %s", target, exc)
            return -1
        return OK

    def close(self) -> int:
        """Not in Mooncake's API (its engine lives as long as the process); frees ours."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        return OK

    def _require(self) -> _Engine:
        if self._engine is None:
            raise ConfigError("TransferEngine: call initialize() first")
        return self._engine
