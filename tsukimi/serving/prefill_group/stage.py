"""A prefill group for chunked pipeline parallelism: k stage processes, each holding a slice
of the layers (tsukimi/engine/pipeline.py), joined by links (tsukimi/serving/prefill_group/stage_link.py).

    router --POST /generate--> stage 0 (head: HTTP, embed, layers [0, a))
                                  | BEGIN prompt, CHUNK hidden c0, c1, ...   (pipelined)
                                  v
                               stage 1 (layers [a, b)) -> ... -> stage k-1 (norm, lm head)
                                  ^                                  |
                                  +------ RESULT first token <-------+

To the router the head is one prefill worker (the same /generate, /health and /load API,
`role = "prefill"`): it answers one token, after every stage has published its layers of the
prompt's blocks to the KV pool (each stage flushes before the result passes it upstream), so
a decode worker then loads the whole prompt from the pool. Greedy only (the first token is an
argmax); one prompt at a time through the group.

`StageProcess` is one stage in this process: the head computes in the caller's thread
(`prefill`, serialised); a later stage runs a loop thread over its inbox (frames from both
links), so a stage computes chunk c while its reader threads already receive chunk c + 1.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from collections.abc import Sequence

import torch

from tsukimi.clock import WallClock
from tsukimi.config.pipeline import PrefillStageConfig
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.kv_pool import KVFormat, StoreKVConnector
from tsukimi.engine.pipeline import PipelineStage, chunk_spans, split_layers
from tsukimi.engine.weights import LoadedModel, load_model
from tsukimi.errors import BrokenConnectionError, ClosedError, RpcTimeout, TsukimiError, error_from_code
from tsukimi.serving.prefill_group.stage_link import Frame, FrameKind, StageLink, connect
from tsukimi.store.client import StoreClient

logger = logging.getLogger(__name__)

_TICK_S = 0.5


class StageProcess:
    """Stage `config.stage` of a prefill group, in this process (see the module). `start()`
    loads the model, joins the store (when `config.master`), listens for the upstream link
    (later stages) and connects downstream; `close()` undoes it."""

    def __init__(self, config: PrefillStageConfig, loaded: LoadedModel | None = None) -> None:
        self.config, self.loaded = config, loaded
        self.inbox: queue.Queue[Frame] = queue.Queue()
        self.stage: PipelineStage | None = None
        self.listen_port = 0
        self._store: StoreClient | None = None
        self._connector: StoreKVConnector | None = None
        self._up: StageLink | None = None
        self._down: StageLink | None = None
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # NOTE: the head: one prompt at a time through the group
        self._next_request = 0

    def start(self) -> StageProcess:
        """Raises ConfigError (model), PeerError/RpcTimeout (store), BrokenConnectionError
        (downstream unreachable within connect_timeout_s), OSError (port)."""
        cfg = self.config
        try:
            torch.set_num_threads(cfg.threads)
            if self.loaded is None:
                self.loaded = load_model(cfg.model, cfg.dtype)
            mc = self.loaded.config
            layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_tokens, mc.torch_dtype)
            if cfg.master:
                self._store = StoreClient.connect(cfg.master, cfg.segment_bytes, transfer_host=cfg.host)
                self._connector = StoreKVConnector(self._store, KVFormat.of(mc.identity, layout))
            spec = split_layers(mc.num_layers, cfg.num_stages)[cfg.stage]
            self.stage = PipelineStage(self.loaded.model, spec, PagedKVCache(layout, cfg.num_blocks), self._connector)
            if not spec.is_first:
                self._listen()
            if not spec.is_last:
                self._down = connect(cfg.downstream, self.inbox, "down", cfg.connect_timeout_s)
            if not spec.is_first:
                self._spawn(self._serve_forever, "serve")
        except BaseException:
            self.close()
            raise
        logger.info(
            "CPP stage %d/%d (layers %d..%d) ready", cfg.stage, cfg.num_stages, spec.first_layer, spec.end_layer - 1
        )
        return self

    def close(self) -> None:
        """Stop the threads, close the links, leave the store (idempotent)."""
        self._stop.set()
        for closable in (self._listener, self._up, self._down):
            if closable is not None:
                closable.close()
        for thread in self._threads:
            thread.join(timeout=2 * _TICK_S)
        if self.stage is not None:
            self.stage.end()
        if self._connector is not None:
            self._connector.close()
        if self._store is not None:
            self._store.close()
        self._listener = self._up = self._down = self._connector = self._store = None
        self._threads = []

    def prefill(self, prompt: Sequence[int]) -> int:
        """The head's work: run `prompt` through the group; its greedy first token, once every
        stage published its KV. Thread-safe (serialised).

        Raises:
            InvalidArgument / OutOfSpace: the prompt (from any stage). RpcTimeout: the group
            took longer than request_timeout_s. BrokenConnectionError: a link broke.
        """
        stage = self.stage
        if stage is None or not stage.spec.is_first:
            raise ClosedError("prefill is the head's (stage 0) and needs a started stage")
        with self._lock:
            torch.set_num_threads(self.config.threads)  # NOTE: per thread (OpenMP): the caller's, not start()'s
            self._next_request += 1
            request, ids = self._next_request, torch.tensor(list(prompt), dtype=torch.int64)
            try:
                stage.begin(prompt)
                if self._down is not None:
                    self._down.send(FrameKind.BEGIN, request, payload=_tensor_bytes(ids))
                out = ids
                for start, count in chunk_spans(len(prompt), self.config.chunk_tokens):
                    out = stage.run_chunk(ids[start : start + count])
                    if self._down is not None:
                        self._down.send(FrameKind.CHUNK, request, start, count, _tensor_bytes(out))
                token = stage.first_token(out) if stage.spec.is_last else None
            finally:
                stage.end()
            return token if token is not None else self._await_result(request)

    def _await_result(self, request: int) -> int:
        clock = WallClock()
        deadline = clock.now() + self.config.request_timeout_s
        while (left := deadline - clock.now()) > 0:
            try:
                frame = self.inbox.get(timeout=min(left, _TICK_S))
            except queue.Empty:
                continue
            if frame.kind is None:
                raise BrokenConnectionError(f"the CPP link {frame.link} broke: {frame.payload.decode()}")
            if frame.request != request:
                continue  # NOTE: a late answer to an earlier request that timed out here
            if frame.kind == FrameKind.RESULT:
                return frame.start
            raise _error_of(frame)
        raise RpcTimeout(f"the CPP group gave no first token within {self.config.request_timeout_s} s")

    # -- a later stage -----------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.create_server((self.config.host, self.config.port))
        listener.settimeout(_TICK_S)
        self._listener, self.listen_port = listener, listener.getsockname()[1]
        self._spawn(self._accept_forever, "accept")

    def _accept_forever(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            sock.settimeout(None)
            if self._up is not None:
                self._up.close()  # NOTE: a new head replaces the old one
            self._up = StageLink(sock, self.inbox, "up")

    def _serve_forever(self) -> None:
        torch.set_num_threads(self.config.threads)  # NOTE: OpenMP's setting is per thread
        while not self._stop.is_set():
            try:
                frame = self.inbox.get(timeout=_TICK_S)
            except queue.Empty:
                continue
            try:
                self._handle(frame)
            except TsukimiError as exc:
                assert self.stage is not None
                self.stage.end()
                self._send_up(FrameKind.ERROR, frame.request, json.dumps([exc.code, str(exc)]).encode())

    def _handle(self, frame: Frame) -> None:
        stage = self.stage
        assert stage is not None
        if frame.kind is None:
            stage.end()  # NOTE: a broken link: the prompt in flight is lost; the head times out
        elif frame.kind == FrameKind.BEGIN:
            stage.begin(torch.frombuffer(frame.payload, dtype=torch.int64).tolist())
            if self._down is not None:
                self._down.send(FrameKind.BEGIN, frame.request, payload=frame.payload)
        elif frame.kind == FrameKind.CHUNK:
            hidden_size = stage.model.config.hidden_size
            dtype = stage.model.config.torch_dtype
            hidden = torch.frombuffer(frame.payload, dtype=dtype).view(frame.count, hidden_size)
            out = stage.run_chunk(hidden)
            if self._down is not None:
                self._down.send(FrameKind.CHUNK, frame.request, frame.start, frame.count, _tensor_bytes(out))
            if stage.done:
                token = stage.first_token(out) if stage.spec.is_last else None
                stage.end()  # NOTE: this stage's layers are in the pool before the result passes here
                if token is not None:
                    self._send_up(FrameKind.RESULT, frame.request, start=token)
        else:  # RESULT / ERROR from downstream: pass it on towards the head
            self._send_up(frame.kind, frame.request, frame.payload, frame.start)

    def _send_up(self, kind: FrameKind, request: int, payload: bytes | bytearray = b"", start: int = 0) -> None:
        if self._up is None:
            logger.warning("CPP stage %d: no upstream link for a %s", self.config.stage, kind.name)
            return
        try:
            self._up.send(kind, request, start=start, payload=payload)
        except BrokenConnectionError as exc:
            logger.warning("CPP stage %d: %s", self.config.stage, exc)

    def _spawn(self, target: object, what: str) -> None:
        thread = threading.Thread(target=target, name=f"tsukimi-cpp-{what}", daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (any dtype, bfloat16 included), without a copy when contiguous."""
    raw: bytes = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return memoryview(raw)


def _error_of(frame: Frame) -> TsukimiError:
    code, message = json.loads(frame.payload)
    return error_from_code(str(code), str(message))
