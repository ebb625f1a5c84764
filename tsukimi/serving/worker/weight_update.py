"""Live weight updates of a worker: `POST /admin/update_weights {"name": N}` (server.py) pulls
the checkpoint published as N through the P2P store (tsukimi/p2p/weights.py) and swaps it into
the running model, with no restart.

    HTTP side (a thread of its own)                   engine thread (engine_thread.py)
    1. stage: receive_state_dict(N) into a fresh      still serving on the old weights
       copy of every parameter (names, dtypes and
       shapes checked before any byte moves)
    2. PauseCommand --------------------------------> drain: requests in the engine end on the
                                                      old weights; new ones are held
                                                      swap: staged -> parameters (in place),
                                                      prefix cache dropped, block hashes salted
                                                      and the KV pool's format digest switched
                                                      to the new weights version
       <--------------------------------------------- resume: held requests run on the new ones
    3. withdraw the staged replica, free the copy

Semantics, and why:
- In-flight requests complete on the old weights before the swap (vLLM's `pause_generation`
  waiting for them); those still running after `drain_timeout_s` fail with WorkerUnavailable.
  No request ever mixes both weights: its KV and tokens come from one.
- A PD request whose first token came from the old weights is refused by a decode worker that
  already has the new ones (WorkerUnavailable: retry it), rather than continued on them: the
  router sends the prefill's `weights_version` along (tsukimi/serving/protocol.py).
- A failed fetch (unknown payload: PayloadNotFound -> 404; another model's manifest:
  InvalidArgument -> 400; a transfer failure) never touches the parameters: the fetch goes to
  a staging copy and the worker keeps serving the old weights. The price is a second copy of
  the weights in memory during an update; the pause itself is only a memory copy.
- The weights version is "NAME@DIGEST" (a blake2b of the bytes received), so equal weights
  give equal versions on every worker (they share KV in the pool) and a name published again
  with other bytes gives another version. The KV pool's format digest includes it
  (tsukimi/engine/kv_pool.py), so no worker reads blocks of other weights, whichever side of
  the update either is on.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tsukimi.clock import WallClock
from tsukimi.config import Config, MetadataConfig
from tsukimi.engine.block_manager import INITIAL_WEIGHTS
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_pool import StoreKVConnector
from tsukimi.errors import ConfigError
from tsukimi.p2p import P2PStore
from tsukimi.p2p.weights import receive_state_dict
from tsukimi.serving.worker.engine_thread import EngineThread, PauseCommand

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UpdateResult:
    """One update's outcome: the new weights version, how long it took (fetch included) and how
    long the engine was paused (drain and swap)."""

    weights_version: str
    seconds: float
    paused_s: float


class WeightUpdater:
    """Swaps new weights into a worker's running model (thread-safe: updates run one at a time).

    Args:
        model: the running model (its parameters are replaced in place).
        connector: the worker's KV pool connector, or None (colocated).
        metadata_url: the metadata service the P2P store keeps its records in; "" = none
            (every update fails with ConfigError).

    NOTE: the P2P store opens a Transfer Engine of its own (at the first update) that publishes
    its segment in that metadata service, rather than sharing the store client's: that one
    runs in p2p handshake mode, and readers that find segments in the service (another worker,
    `tsukimi p2p fetch`) could not reach a holder that is not published there.
    """

    def __init__(self, model: torch.nn.Module, connector: StoreKVConnector | None, metadata_url: str) -> None:
        self.model, self.connector, self.metadata_url = model, connector, metadata_url
        self.weights_version = INITIAL_WEIGHTS
        self._lock = threading.Lock()
        self._store: P2PStore | None = None
        self._clock = WallClock()

    def update(self, engine: EngineThread, name: str, drain_timeout_s: float) -> UpdateResult:
        """Fetch payload `name` and swap it in (blocks until done; mutates the model, the engine
        and the connector).

        Raises:
            ConfigError: no metadata service. PayloadNotFound: no such payload. InvalidArgument:
            its manifest does not match the model. TransferError / MetadataError: the fetch
            failed (the old weights stay). ClosedError: the worker shut down meanwhile.
        """
        with self._lock:
            start = self._clock.now()
            store = self._open_store()
            staged = {key: torch.empty_like(t) for key, t in self.model.state_dict().items()}
            receive_state_dict(store, name, staged)
            try:
                version = f"{name}@{_digest(staged)}"
                paused = self._clock.now()
                done: Future[None] = Future()
                swap = functools.partial(self._swap, engine, staged=staged, version=version)
                engine.submit(PauseCommand(swap, done, drain_timeout_s))
                done.result()
            finally:
                store.delete_replica(name)  # NOTE: the staged copy is freed next: nobody may read it
            end = self._clock.now()
            logger.info("weights %s in place in %.2f s (paused %.2f s)", version, end - start, end - paused)
            return UpdateResult(version, end - start, end - paused)

    def _swap(self, thread: EngineThread, llm: LLMEngine, staged: Mapping[str, torch.Tensor], version: str) -> None:
        """On the drained engine thread: the parameters, the prefix cache, the KV format."""
        with torch.no_grad():
            for key, tensor in self.model.state_dict().items():
                tensor.copy_(staged[key])
        self.weights_version = thread.weights_version = version
        dropped = llm.new_weights(version)
        if self.connector is not None:
            self.connector.use_format(dataclasses.replace(self.connector.format, weights_version=version))
        logger.info("weights version %s: %d cached KV blocks dropped", version, dropped)

    def prepare(self, llm: LLMEngine) -> LLMEngine:
        """`llm`, a fresh engine on the current weights, keyed for them (mutates it)."""
        if self.weights_version != INITIAL_WEIGHTS:
            llm.new_weights(self.weights_version)
        return llm

    def _open_store(self) -> P2PStore:
        if self._store is None:
            if not self.metadata_url:
                raise ConfigError("live weight updates need a metadata service: start the worker with --metadata-url")
            config = dataclasses.replace(Config(), metadata=MetadataConfig(url=self.metadata_url))
            self._store = P2PStore(config)
        return self._store

    def close(self) -> None:
        """Close the P2P store (idempotent)."""
        with self._lock:
            if self._store is not None:
                self._store.close()
            self._store = None


def _digest(state: Mapping[str, torch.Tensor]) -> str:
    """A short hex digest of the tensors' names and bytes (pure)."""
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(state):
        h.update(key.encode())
        h.update(memoryview(state[key].contiguous().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
    return h.hexdigest()
