"""PD "direct" hand-over: the producer's side channel and the consumer's reads.

The producer's worker serves two calls on `pd_host:pd_port` (tsukimi's RPC, msgspec over TCP):

    Describe() -> KVLayout     its Transfer Engine segment, each layer's base address, the
                               bytes of one block and the KV format digest
    Release(request_id)        the consumer has its blocks: the producer may free them

The consumer opens the producer's segment with its own Transfer Engine and READs every
(layer, block) straight into its KV buffer: with both on one host that is shared memory or
CMA (process_vm_readv), no staging copy; elsewhere TCP (or RDMA where configured).

    remote address of (layer l, block b) = layer_bases[l] + b * block_bytes
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import msgspec
import torch

from tsukimi.errors import ProtocolError, TsukimiError
from tsukimi.rpc.client import RpcClient
from tsukimi.rpc.codec import Codec
from tsukimi.rpc.server import RpcServer
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.batch import OpCode, RequestState, TransferRequest

logger = logging.getLogger(__name__)


class Describe(msgspec.Struct, tag=True, frozen=True):
    pass


class KVLayout(msgspec.Struct, tag=True, frozen=True):
    segment: str
    layer_bases: list[int]
    block_bytes: int
    num_blocks: int
    digest: str


class Release(msgspec.Struct, tag=True, frozen=True):
    request_id: str


class Released(msgspec.Struct, tag=True, frozen=True):
    pass


CODEC = Codec([Describe, Release], [KVLayout, Released])


class SideChannel:
    """The producer's side channel; `take_released()` hands over the request ids the
    consumers are done with. Thread-safe; close() when done.

    Raises (constructor): ConfigError when it cannot bind.
    """

    def __init__(self, layout: KVLayout, host: str, port: int) -> None:
        self._layout = layout
        self._released: set[str] = set()
        self._lock = threading.Lock()
        self._server = RpcServer(CODEC, self._handle, f"tcp://{host}:{port}", name="vllm-pd")

    @property
    def endpoint(self) -> str:
        return self._server.endpoint

    def _handle(self, request: msgspec.Struct) -> msgspec.Struct:
        if isinstance(request, Describe):
            return self._layout
        if isinstance(request, Release):
            with self._lock:
                self._released.add(request.request_id)
            return Released()
        raise ProtocolError(f"unexpected request {type(request).__name__}")

    def take_released(self) -> set[str]:
        """The request ids released since the last call (mutates)."""
        with self._lock:
            released, self._released = self._released, set()
        return released

    def close(self) -> None:
        self._server.close()


class PeerReader:
    """The consumer's view of producers: their layouts (asked once each) and the READs."""

    def __init__(self, engine: TransferEngine, layers: Sequence[torch.Tensor], timeout_s: float) -> None:
        self._engine = engine
        self._layers = list(layers)
        self._timeout_s = timeout_s
        self._peers: dict[tuple[str, int], tuple[RpcClient, KVLayout]] = {}
        self._lock = threading.Lock()

    def _peer(self, host: str, port: int) -> tuple[RpcClient, KVLayout]:
        with self._lock:
            known = self._peers.get((host, port))
        if known is not None:
            return known
        client = RpcClient(CODEC, f"tcp://{host}:{port}", timeout_s=self._timeout_s)
        try:
            layout = client.call_as(Describe(), KVLayout)
        except BaseException:
            client.close()
            raise
        with self._lock:
            self._peers[(host, port)] = (client, layout)
        return client, layout

    def read(self, host: str, port: int, digest: str, remote_ids: Sequence[int], local_ids: Sequence[int]) -> set[int]:
        """READ the producer's blocks `remote_ids` into local blocks `local_ids` (all layers);
        returns the local block ids that could not be read (all of them when the producer is
        unreachable or its format differs). Never raises for the producer's faults."""
        try:
            _, layout = self._peer(host, port)
        except TsukimiError as exc:
            logger.warning("PD producer %s:%d unreachable: %s", host, port, exc)
            return set(local_ids)
        if layout.digest != digest or len(layout.layer_bases) != len(self._layers):
            logger.warning("PD producer %s:%d has another KV format; recomputing", host, port)
            return set(local_ids)
        requests = [
            TransferRequest(OpCode.READ, layout.segment, base + remote * layout.block_bytes, layer[local])
            for remote, local in zip(remote_ids, local_ids, strict=True)
            for base, layer in zip(layout.layer_bases, self._layers, strict=True)
        ]
        try:
            statuses = self._engine.transfer(requests, self._timeout_s * 5)
        except TsukimiError as exc:
            logger.warning("PD read from %s:%d failed: %s", host, port, exc)
            return set(local_ids)
        num_layers = len(self._layers)
        return {
            local_ids[i // num_layers]
            for i, status in enumerate(statuses)
            if status.state is not RequestState.COMPLETED
        }

    def release(self, host: str, port: int, request_id: str) -> None:
        """Tell the producer its request's blocks may go (best effort: its lease ends anyway)."""
        try:
            client, _ = self._peer(host, port)
            client.call_as(Release(request_id), Released)
        except TsukimiError as exc:
            logger.info("releasing %s at %s:%d: %s (its lease will end)", request_id, host, port, exc)

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for client, _ in peers:
            client.close()
