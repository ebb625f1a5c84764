"""The connector's worker half: vLLM's KV buffer registered with the Transfer Engine, loads
into it (asynchronous, batched), saves from it (layer by layer), and the PD producer's leases.

Every byte moves between the pool (or a PD producer) and the KV buffer itself: a get names
`layer[block]` views of the buffer as its destinations, a put names them as its sources. The
buffer is registered once (all layers are views of one allocation on CPU) so that PD
consumers can READ it.

Loads run on a thread of their own between scheduler steps (`load_async`): `start_load_kv`
submits, `get_finished` reports the request once its blocks are in, and any block that could
not be read (a miss, a corrupt copy, a dead holder or producer) goes to
`get_block_ids_with_load_errors`, so vLLM recomputes from the first such block.
Saves: with `save_per_layer`, `save_kv_layer` hands each layer's batch to a thread while later
layers compute and `wait_for_save` waits for them all (the blocks are freed only after it).

A KV cache on a GPU (vLLM's layout per layer, [blocks, *block_shape], blocks contiguous) takes
the same calls: the store stages device memory (tsukimi/store/device_io.py), so a load is one
pool read into pinned staging, one host->GPU copy and one scatter kernel per layer's
allocation, a save one gather and one GPU->host copy, never a copy per block. A save first
waits for a CUDA event recorded on the model's stream when vLLM handed the layer over (the
ordering contract: tsukimi reads device memory only once the work that wrote it is done). The
GPU buffer is registered with the Transfer Engine as device memory, so PD "direct" hand-over (a
consumer READing the producer's KV buffer) moves GPU to GPU: CUDA IPC on one host
(tsukimi/transfer/transports/device_ipc.py), pinned staging on both sides across hosts.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tsukimi.errors import ConfigError, ObjectExists, TsukimiError
from tsukimi.integrations.vllm.config import PoolLink, TsukimiConnectorConfig
from tsukimi.integrations.vllm.keys import KVFormat, block_key
from tsukimi.integrations.vllm.metadata import LoadSpec, SaveSpec, TsukimiConnectorMetadata
from tsukimi.integrations.vllm.pd import KVLayout, PeerReader, SideChannel
from tsukimi.integrations.vllm.stats import StatsRecorder
from tsukimi.transfer import TransferEngine

logger = logging.getLogger(__name__)


def _layer_number(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


class ConnectorWorker:
    """Worker-side state; vLLM calls it from its model runner thread."""

    def __init__(self, config: TsukimiConnectorConfig, fmt: KVFormat, role: str) -> None:
        self._config = config
        self._format = fmt
        self._digest = fmt.digest()
        self._role = role
        self._engine = TransferEngine(config=config.tsukimi_config())
        self._pool = PoolLink(config, self._engine)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tsukimi-kv-load")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tsukimi-kv-save")
        self._layers: list[torch.Tensor] = []
        self._on_device = False  # the KV cache is in GPU memory
        self._layer_index: dict[str, int] = {}
        self._loading: dict[str, tuple[LoadSpec, Future[set[int]]]] = {}
        self._load_errors: set[int] = set()
        self._saving: list[Future[None]] = []
        self._leases: dict[str, float] = {}  # PD producer: request id -> when its blocks go anyway
        self._released: dict[str, float] = {}  # released by a consumer (request id -> when)
        self._side: SideChannel | None = None
        self._peers: PeerReader | None = None
        self.stats = StatsRecorder()

    # -- setup -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV buffer (each distinct allocation once) and check its layout.

        Raises:
            ConfigError: the layers do not match the KV format, or a block of a layer is not
                contiguous (a layout this connector does not handle).
        """
        names = sorted(kv_caches, key=_layer_number)
        self._layers = [kv_caches[name] for name in names]
        self._layer_index = {name: i for i, name in enumerate(names)}
        shape = self._format.block_shape
        for name, layer in zip(names, self._layers, strict=True):
            if tuple(layer.shape[1:]) != shape or not layer[0].is_contiguous() or not layer.is_contiguous():
                raise ConfigError(f"KV layer {name} is {tuple(layer.shape)} {layer.stride()}: want [blocks, *{shape}]")
        if len(self._layers) != self._format.num_layers:
            raise ConfigError(f"{len(self._layers)} KV layers, the format says {self._format.num_layers}")
        self._on_device = self._layers[0].device.type != "cpu"
        storages: dict[int, int] = {}
        for layer in self._layers:
            storage = layer.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        for address, nbytes in storages.items():
            self._engine.register((address, nbytes))
        block_bytes = self._layers[0][0].numel() * self._layers[0].element_size()
        logger.info(
            "TsukimiConnector: %d KV layers on %s in %d registered buffer(s), %d blocks of %d bytes per layer, "
            "format %s",
            len(self._layers),
            self._layers[0].device,
            len(storages),
            self._layers[0].shape[0],
            block_bytes,
            self._digest,
        )
        self._peers = PeerReader(self._engine, self._layers, self._config.rpc_timeout_s)
        if self._role == "kv_producer" and self._config.pd_port:
            layout = KVLayout(
                self._engine.name,
                [layer.data_ptr() for layer in self._layers],
                block_bytes,
                int(self._layers[0].shape[0]),
                self._digest,
            )
            self._side = SideChannel(layout, self._config.pd_host, self._config.pd_port)

    # -- loads -------------------------------------------------------------------------

    def start_load_kv(self, meta: TsukimiConnectorMetadata) -> None:
        """Start this step's loads (asynchronous ones return at once)."""
        for lease in meta.sends:
            self._leases[lease.req_id] = time.monotonic() + self._config.pd_lease_s
        for spec in meta.loads:
            future = self._loader.submit(self._load, spec)
            if self._config.load_async:
                self._loading[spec.req_id] = (spec, future)
            else:
                self._load_errors |= future.result()

    def _load(self, spec: LoadSpec) -> set[int]:
        """Load one request's blocks; the local block ids that failed."""
        if self._config.fault_load_delay_s:
            time.sleep(self._config.fault_load_delay_s)
        started = time.perf_counter()
        if spec.remote is not None:
            assert self._peers is not None
            remote = spec.remote
            failed = set()
            if spec.block_ids:
                failed = self._peers.read(remote.host, remote.port, remote.digest, remote.block_ids, spec.block_ids)
            self._peers.release(remote.host, remote.port, remote.request_id)
        else:
            failed = self._load_from_pool(spec)
        seconds = time.perf_counter() - started
        source = "pool" if spec.remote is None else "direct"
        self.stats.loaded(source, len(spec.block_ids), len(failed), seconds)
        logger.debug(
            "loaded %s: %d blocks from %s in %.3f ms, %d failed",
            spec.req_id,
            len(spec.block_ids),
            source,
            1000 * seconds,
            len(failed),
        )
        return failed

    def _load_from_pool(self, spec: LoadSpec) -> set[int]:
        client = self._pool.client()
        if client is None:
            return set(spec.block_ids)
        keys, views = self._keys_and_views(spec.block_ids, spec.block_hashes, range(len(self._layers)))
        try:
            results = client.batch_get(keys, into=views)
        except TsukimiError as exc:
            self._pool.failed(exc)
            return set(spec.block_ids)
        num_layers = len(self._layers)
        want = views[0].numel() * views[0].element_size() if views else 0
        return {spec.block_ids[i // num_layers] for i, r in enumerate(results) if r.error or r.size != want}

    def _keys_and_views(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], layers: Sequence[int]
    ) -> tuple[list[str], list[torch.Tensor]]:
        """Keys and KV views of the given layers of these blocks, block-major."""
        keys, views = [], []
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            for layer in layers:
                keys.append(block_key(self._digest, block_hash, layer))
                views.append(self._layers[layer][block_id])
        return keys, views

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(PD sends done, loads done): a load counts as done failed or not."""
        recving = {req_id for req_id, (_, future) in self._loading.items() if future.done()}
        for req_id in recving:
            spec, future = self._loading.pop(req_id)
            try:
                self._load_errors |= future.result()
            except Exception:  # NOTE: a bug in a load must mean recompute, never a wrong token or a hang
                logger.exception("loading %s failed; recomputing its blocks", req_id)
                self._load_errors |= set(spec.block_ids)
        return self._ended_leases() or None, recving or None

    def _ended_leases(self) -> set[str]:
        """PD producer: the requests whose consumer released them, or whose lease ran out.
        NOTE: a release may come before this worker learns of the lease (the consumer is fast,
        the lease arrives with the next step's metadata): such releases wait here a lease long."""
        if self._side is None:
            return set()
        now = time.monotonic()
        for req_id in self._side.take_released():
            self._released[req_id] = now
        ended: set[str] = set()
        for req_id, deadline in list(self._leases.items()):
            released = self._released.pop(req_id, None) is not None
            if released or now > deadline:
                if not released:
                    logger.warning("PD consumer never released %s; freeing its blocks", req_id)
                del self._leases[req_id]
                ended.add(req_id)
        for req_id, when in list(self._released.items()):
            if now - when > self._config.pd_lease_s:
                del self._released[req_id]
        return ended

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks that failed since the last call (mutates: resets them)."""
        errors, self._load_errors = self._load_errors, set()
        if errors:
            self.stats.load_errors(len(errors))
        return errors

    # -- saves -------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, saves: Sequence[SaveSpec]) -> None:
        """Start putting this layer's saved blocks (per-layer mode only)."""
        if not saves or not self._config.save_per_layer:
            return
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self._saving.append(self._saver.submit(self._put, saves, [layer], self._written()))

    def wait_for_save(self, saves: Sequence[SaveSpec]) -> None:
        """Put what is left and wait for every put of this step (blocks stay valid until then)."""
        if saves and not self._config.save_per_layer:
            self._saving.append(self._saver.submit(self._put, saves, range(len(self._layers)), self._written()))
        started = time.perf_counter()
        for future in self._saving:
            future.result()
        self._saving.clear()
        if saves:
            self.stats.save_waited(time.perf_counter() - started)

    def _written(self) -> torch.cuda.Event | None:
        """On a GPU: an event recorded now on the model's stream (a save waits for it, so it
        reads what the layer's kernels wrote); None on CPU."""
        if not self._on_device:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._layers[0].device))
        return event

    def _put(self, saves: Sequence[SaveSpec], layers: Sequence[int], written: torch.cuda.Event | None = None) -> None:
        client = self._pool.client()
        if client is None:
            return
        if written is not None:
            written.synchronize()
        items: list[tuple[str, object]] = []
        for spec in saves:
            keys, views = self._keys_and_views(spec.block_ids, spec.block_hashes, layers)
            items += zip(keys, views, strict=True)
        started = time.perf_counter()
        try:
            errors = client.batch_put(items)
        except TsukimiError as exc:
            self._pool.failed(exc)
            return
        failed = sum(1 for e in errors if e is not None and not isinstance(e, ObjectExists))
        self.stats.saved(len(items), failed, time.perf_counter() - started)

    def close(self) -> None:
        for future in self._saving:
            future.cancel()
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._saver.shutdown(wait=True, cancel_futures=True)
        if self._side is not None:
            self._side.close()
        if self._peers is not None:
            self._peers.close()
        self._pool.close()
        self._engine.close()
