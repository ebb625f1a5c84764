"""What the router needs of one kind of worker, as two small protocols: `Backend` (how to
reach a worker) and `CacheKeys` (how placement sees its KV cache). The router
(tsukimi/serving/router/router.py) runs the same placement, retries and decision log over any
implementation of both:

    tsukimi workers   WorkerClient (tsukimi/serving/router/worker_client.py): POST /generate
                      (NDJSON), GET /health, GET /load; keys: hash_blocks + the weights salt;
                      KV events: each prefill worker's publisher (its /health says where)
    vLLM instances    VllmBackend (tsukimi/integrations/vllm/backend.py): POST /v1/completions
                      (SSE, token ids), GET /health, GET /metrics; keys: vLLM's own block
                      hashes; KV events: each instance's ZMQ publisher (the config says where)

    Backend.stream(worker, request, stage)   the worker's token chunks for one request, the
                                             last with a finish reason; `stage`: "prefill" (PD:
                                             the first token, the KV handed over), "decode"
                                             (PD: from the prefill's hand-over on) or "whole"
    Backend.poll(worker)                     its load now
    Backend.health(worker)                   discovery: its role, block size, what it reports

A PD request's prefill stage ends with a chunk carrying the backend's `handover` (vLLM: the
kv_transfer_params the prefill instance answered; tsukimi: nothing, the pool carries the KV),
which the router passes to the decode stage's `stream` unread.

Errors, whatever the backend: a worker that cannot be reached raises `WorkerUnavailable`, one
that fails, stalls or answers garbage `WorkerError`; an error a worker reports is raised as its
own class; `poll` and `health` raise `RpcTimeout` when the worker answered too late (the
router's own loop may be the one lagging: tsukimi/serving/router/liveness.py decides).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

from tsukimi.errors import TsukimiError
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.scheduler.prefix_index import Tier
from tsukimi.serving.kv_events import EventSource
from tsukimi.serving.protocol import GenerateRequest, Health, Load, TokenChunk, UpdateWeightsReply, UpdateWeightsRequest
from tsukimi.serving.router.workers import WorkerHandle

Stage = Literal["whole", "prefill", "decode"]
Handover = dict[str, object]  # what a PD prefill stage leaves for its decode stage (JSON), opaque to the router


class StageChunk(msgspec.Struct, frozen=True):
    """One chunk of a stage: the worker's `TokenChunk`, and on a prefill stage's last chunk the
    hand-over for the decode stage (None: none)."""

    chunk: TokenChunk
    handover: Handover | None = None


class Backend(Protocol):
    """How the router reaches one kind of worker (see the module). Not thread-safe: the
    router's event loop."""

    kind: str  # "tsukimi" | "vllm": what the workers are, in logs and /health

    def stream(
        self, worker: WorkerHandle, request: GenerateRequest, stage: Stage, handover: Handover | None = None
    ) -> AsyncGenerator[StageChunk, None]:
        """The worker's chunks for `request` (the last has a finish reason); close early to abort.

        Raises (from the iterator): the worker's own error as its class; WorkerUnavailable
            (unreachable: the worker is marked down when it refused or broke the connection);
            WorkerError (it failed, stalled or answered garbage).
        """
        ...

    async def poll(self, worker: WorkerHandle) -> Load:
        """Its load now. Raises RpcTimeout (late) or WorkerError (anything else)."""
        ...

    async def health(self, worker: WorkerHandle) -> Health:
        """What it says of itself: its role, block size, KV events, cost profile, CPP group.
        Raises RpcTimeout (late) or WorkerError (anything else)."""
        ...

    async def aclose(self) -> None:
        """Closes its connections (idempotent); a later call opens new ones."""
        ...


class CacheKeys(Protocol):
    """How placement sees the workers' KV caches: the keys their KV events give blocks, the
    tier of the index those caches sit in, and whether their stored blocks also reach the KV
    pool. Pure but for `events` reading the handle."""

    tier: Tier  # the index tier of a worker's own cache ("dram": tsukimi's CPU pool; "hbm": vLLM's)
    pooled: bool  # every block a worker stores is in the KV pool too (reuse may fetch from there)
    colocated_conductor: bool  # "auto" places colocated workers with the Conductor (their events feed it)

    def block_keys(self, prompt: Sequence[int], block_tokens: int) -> list[BlockHash]:
        """The index keys of the prompt's full blocks, as the workers' KV events name them."""
        ...

    def events(self, worker: WorkerHandle, health: Health | None) -> EventSource | None:
        """Where `worker` publishes the KV events the index learns from (None: it feeds nothing);
        `health`: what it last said of itself (None: not asked)."""
        ...


class RouterBackend(Backend, CacheKeys, Protocol):
    """A backend with its cache keys: what `Router` takes."""


@runtime_checkable
class WeightUpdates(Protocol):
    """A backend whose workers take live weight updates (tsukimi's: POST /admin/update_weights)."""

    async def update_weights(
        self, workers: Sequence[WorkerHandle], request: UpdateWeightsRequest, secret: bytes | None
    ) -> dict[str, UpdateWeightsReply | TsukimiError]:
        """Each worker's reply or error; the keys follow the weights the workers now run."""
        ...
