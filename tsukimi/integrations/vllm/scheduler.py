"""The connector's scheduler half: how much of a prompt the pool (or a PD producer) holds,
which blocks to load into, which to save, and the PD hand-over parameters.

One lookup per request is one `batch_exists` call for all its candidate (block, layer) keys;
the answer is kept until the request is scheduled, so vLLM asking again costs nothing. While
the master is down every lookup answers 0 (plain vLLM; config.PoolLink).

PD (vLLM's proxy protocol, as NixlConnector and MooncakeConnector speak it): the proxy sends
the prompt to the producer with `kv_transfer_params={"do_remote_decode": true}` and
max_tokens=1. In "direct" mode (the config's `pd_mode`, or the request's `tsukimi_pd_mode`
param) the producer does not save; its `request_finished` keeps the full prompt blocks and
returns `{"do_remote_prefill": true, "remote_host", "remote_port", "remote_request_id",
"remote_block_ids", "tsukimi_format"}`, which the proxy passes to the consumer, whose worker
READs those blocks from the producer's KV buffer and tells it to let go. In "pool" mode the
producer saves the blocks like any request and returns no params: the consumer finds them by
hash.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tsukimi.errors import TsukimiError
from tsukimi.integrations.vllm.config import PoolLink, TsukimiConnectorConfig
from tsukimi.integrations.vllm.keys import (
    KVFormat,
    block_keys,
    blocks_to_save,
    leading_hits,
    max_loadable_blocks,
)
from tsukimi.integrations.vllm.metadata import LoadSpec, RemoteSource, SaveSpec, SendSpec, TsukimiConnectorMetadata

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Lookup:
    """A request's answer: blocks [start, start + num_blocks) can be loaded."""

    start: int
    num_blocks: int
    remote: RemoteSource | None = None


@dataclass(slots=True)
class _Tracker:
    """A running request's save progress."""

    request: Any  # vllm.v1.request.Request
    block_ids: list[int]
    num_saved: int


class ConnectorScheduler:
    """Scheduler-side state. Not thread-safe (vLLM's scheduler calls it from one thread)."""

    def __init__(self, config: TsukimiConnectorConfig, fmt: KVFormat, role: str, engine_id: str) -> None:
        self._config = config
        self._format = fmt
        self._digest = fmt.digest()
        self._block_size = fmt.block_size
        self._loads_enabled = role in ("kv_both", "kv_consumer")
        self._saves_enabled = role in ("kv_both", "kv_producer")
        self._sends_enabled = role == "kv_producer" and config.pd_port != 0
        self._engine_id = engine_id
        self._pool = PoolLink(config)
        self._lookups: dict[str, _Lookup] = {}
        self._loads: list[LoadSpec] = []
        self._sends: list[SendSpec] = []
        self._trackers: dict[str, _Tracker] = {}
        self._new: dict[str, Any] = {}  # requests allocated, not yet seen scheduled

    # -- lookups ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens to load beyond `num_computed_tokens`, whether the load is asynchronous)."""
        if not self._loads_enabled:
            return 0, False
        lookup = self._lookups.get(request.request_id)
        if lookup is None:
            lookup = self._lookup(request, num_computed_tokens)
            self._lookups[request.request_id] = lookup
        num_tokens = (lookup.start + lookup.num_blocks) * self._block_size - num_computed_tokens
        if lookup.num_blocks == 0 or num_tokens <= 0:
            return 0, False
        return num_tokens, self._config.load_async

    def _lookup(self, request: Any, num_computed_tokens: int) -> _Lookup:
        start = num_computed_tokens // self._block_size
        cap = max_loadable_blocks(request.num_tokens, self._block_size)
        remote = _remote_source(request.kv_transfer_params)
        if remote is not None:
            if remote.digest != self._digest:
                logger.warning("request %s: the producer's KV format differs; recomputing", request.request_id)
                return _Lookup(start, 0, remote)
            return _Lookup(start, max(0, min(cap, len(remote.block_ids)) - start), remote)
        hashes = request.block_hashes[start:cap]
        client = self._pool.client() if hashes else None
        if client is None:
            return _Lookup(start, 0)
        keys = [key for block_hash in hashes for key in block_keys(self._digest, block_hash, self._format.num_layers)]
        try:
            found = client.batch_exists(keys)
        except TsukimiError as exc:
            self._pool.failed(exc)
            return _Lookup(start, 0)
        return _Lookup(start, leading_hits(found, self._format.num_layers))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the load into the blocks vLLM just allocated (it may call this twice for an
        async load: the second time with 0 tokens, ignored)."""
        if self._saves_enabled and self._pd_mode(request) != "direct":
            self._new[request.request_id] = request
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        if num_external_tokens <= 0:
            if lookup.remote is not None:  # the producer still holds the blocks: let it go
                self._loads.append(LoadSpec(request.request_id, (), remote=lookup.remote))
            return
        end = lookup.start + lookup.num_blocks
        local = tuple(blocks.get_block_ids()[0][lookup.start : end])
        if lookup.remote is not None:
            remote = lookup.remote
            picked = RemoteSource(
                remote.host, remote.port, remote.request_id, remote.block_ids[lookup.start : end], remote.digest
            )
            self._loads.append(LoadSpec(request.request_id, local, remote=picked))
        else:
            hashes = tuple(bytes(h) for h in request.block_hashes[lookup.start : end])
            self._loads.append(LoadSpec(request.request_id, local, block_hashes=hashes))

    # -- per step ----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> TsukimiConnectorMetadata:
        """This step's loads, saves and sends; resets them (mutates)."""
        meta = TsukimiConnectorMetadata(loads=self._loads, sends=self._sends)
        self._loads, self._sends = [], []
        for req_id in scheduler_output.finished_req_ids:
            self._trackers.pop(req_id, None)
            self._lookups.pop(req_id, None)
            self._new.pop(req_id, None)
        if not self._saves_enabled:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._new.pop(new.req_id, None)
            if request is None:
                continue
            tracker = _Tracker(request, list(new.block_ids[0]), new.num_computed_tokens // self._block_size)
            self._trackers[new.req_id] = tracker
            self._add_save(meta, new.req_id, tracker, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._trackers.get(req_id)
            if known is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                known.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                known.block_ids += new_ids[0]
            self._add_save(meta, req_id, known, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def _add_save(self, meta: TsukimiConnectorMetadata, req_id: str, tracker: _Tracker, num_done: int) -> None:
        request = tracker.request
        span = blocks_to_save(tracker.num_saved, num_done, request.num_prompt_tokens, self._block_size)
        end = min(span.end, len(request.block_hashes), len(tracker.block_ids))
        if end <= span.start:
            return
        hashes = tuple(bytes(h) for h in request.block_hashes[span.start : end])
        meta.saves.append(SaveSpec(req_id, tuple(tracker.block_ids[span.start : end]), hashes))
        logger.debug(
            "saving %s blocks %d-%d, format %s, hashes %s",
            req_id,
            span.start,
            end,
            self._digest,
            ",".join(h.hex() for h in hashes),
        )
        tracker.num_saved = end

    # -- finish ------------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A PD producer keeps a `do_remote_decode` request's full prompt blocks for the
        consumer and returns the params the proxy passes on; everything else frees at once."""
        if not (self._sends_enabled and self._pd_mode(request) == "direct"):
            return False, None
        num_full = min(len(block_ids), request.num_prompt_tokens // self._block_size)
        if num_full == 0:
            return False, None
        held = tuple(block_ids[:num_full])
        self._sends.append(SendSpec(request.request_id, held))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_host": self._config.pd_host,
            "remote_port": self._config.pd_port,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(held),
            "tsukimi_format": self._digest,
        }

    def _pd_mode(self, request: Any) -> str | None:
        """How a `do_remote_decode` request hands its KV over ("pool" or "direct": the
        request's `tsukimi_pd_mode` param, else the config's); None for other requests."""
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return None
        return str(params.get("tsukimi_pd_mode", self._config.pd_mode))

    def close(self) -> None:
        self._pool.close()


def _remote_source(params: dict[str, Any] | None) -> RemoteSource | None:
    """The producer's blocks named by a consumer request's `kv_transfer_params`, if any."""
    if not params or not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
        return None
    return RemoteSource(
        host=str(params["remote_host"]),
        port=int(params["remote_port"]),
        request_id=str(params["remote_request_id"]),
        block_ids=tuple(int(b) for b in params["remote_block_ids"]),
        digest=str(params.get("tsukimi_format", "")),
    )
