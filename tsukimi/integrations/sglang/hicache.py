"""`TsukimiHiCacheStorage`: SGLang's HiCache L3 storage on tsukimi's store, loaded by SGLang's
`dynamic` storage backend (it imports this module in SGLang's own venv, so `sglang` is
imported here at module load):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tsukimi",
        "module_path": "tsukimi.integrations.sglang.hicache",
        "class_name": "TsukimiHiCacheStorage", "interface_v1": 1,
        "master": "tcp://127.0.0.1:50051"}'

The factory calls `TsukimiHiCacheStorage(storage_config, kwargs)`; the other extra_config keys
are settings.py's. Each rank holds one `StoreClient` and moves bytes zero-copy between the
store and SGLang's host-pool pages (the pointers of the pool's `get_page_buffer_meta`): one
object per page and rank suffix (keys.py), whose parts are that page's buffers (MHA: [k, v];
MLA layer_first: one per layer).

    batch_set_v1   one exists batch, then one put batch of the missing pages (an object that
                   exists already, or appears meanwhile, is a success)
    batch_get_v1   one get batch straight into the pages
    batch_exists   one exists batch; the leading run of complete pages
    *_v2           the same over every PoolTransfer of the call at once (KV and side pools)
    get/set/batch_get/batch_set/exists   the legacy calls: SGLang's generic path (one flat
                   tensor per page, without "interface_v1") and (pointer, size) targets

Every call is bounded by the client's timeouts (settings.py) and answers failures as False
(0 pages) with one log line; no exception reaches SGLang's cache controller.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from tsukimi.errors import InvalidArgument, ObjectExists, TsukimiError
from tsukimi.integrations.sglang.keys import PageKeys, RankLayout
from tsukimi.integrations.sglang.settings import HiCacheSettings
from tsukimi.store import protocol as p
from tsukimi.store.client import StoreClient

logger = logging.getLogger(__name__)

Part = tuple[int, int]  # (address, bytes) in a host pool
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PageGroup:
    """The pages of one pool in one call: their SGLang page keys, host indices, the pool, and
    its name in object keys ("" for the KV pool)."""

    keys: Sequence[str]
    host_indices: torch.Tensor
    pool: object
    pool_name: str = ""


def rank_layout(config: HiCacheStorageConfig) -> RankLayout:
    """The key-relevant fields of SGLang's storage config. Pure."""
    split = config.tp_lcm_size // config.tp_size if config.should_split_heads and config.tp_lcm_size else 0
    return RankLayout(
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        is_mla=config.is_mla_model,
        split_factor=split,
        dcp_rank=getattr(config, "dcp_rank", 0),
        dcp_size=getattr(config, "dcp_size", 1),
        attn_cp_rank=config.attn_cp_rank,
        logical_page_size=getattr(config, "logical_page_size", None) or 0,
    )


class TsukimiHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped here
    """One rank's HiCache storage on a tsukimi master (see the module). Thread-safe as the
    StoreClient is.

    Raises (from `__init__`, failing SGLang's startup as its MooncakeStore does):
        ConfigError: a bad extra_config. TsukimiError: the master is unreachable.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, object] | None = None) -> None:
        self.settings = HiCacheSettings.from_extra(storage_config.extra_config or {})
        self.layout = rank_layout(storage_config)
        self.keys = PageKeys.build(self.settings.model_tag or storage_config.model_name or "", self.layout)
        self.registered_pools: dict[str, object] = {}
        self.mem_pool_host: object = None
        self._metrics = storage_config.enable_storage_metrics
        self._pages: dict[str, list[int]] = {"prefetch": [], "backup": []}
        self._gbps: dict[str, list[float]] = {"prefetch": [], "backup": []}
        self._client = StoreClient(self.settings.tsukimi_config())
        # NOTE: a rank reads back the pages it wrote (its own TP shard): in its own segment that read is a memcpy
        mine = (self._client.engine.name,) if self.settings.local_first and self.settings.segment_bytes else ()
        self._config = p.ReplicaConfig(self.settings.replicas, preferred_segments=mine)
        logger.info("tsukimi HiCache storage on %s, keys sglang/%s/*", self.settings.master, self.keys.model)
        if not (storage_config.extra_config or {}).get("interface_v1"):
            logger.warning(
                'extra_config has no "interface_v1": 1: SGLang copies every page through batch_get/batch_set'
            )

    # -- v1: the KV pool ---------------------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the pages `keys` from the host pool at `host_indices`; each page's success."""
        group = PageGroup(keys, host_indices, self.mem_pool_host)
        return self._guard("batch_set_v1", [False] * len(keys), lambda: self._set_groups([group])[0])

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read the pages `keys` into the host pool at `host_indices`; each page's success."""
        group = PageGroup(keys, host_indices, self.mem_pool_host)
        return self._guard("batch_get_v1", [False] * len(keys), lambda: self._get_groups([group])[0])

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of `keys`, from the first, are stored completely (0 on a failure)."""
        return self._guard("batch_exists", 0, lambda: _leading(self._exist_pages(keys, "")))

    # -- v2: every pool of a call at once ------------------------------------------------

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages from its pool; each pool's per-page successes."""
        return self._v2("batch_set_v2", transfers, self._set_groups)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its pool; each pool's per-page successes."""
        return self._v2("batch_get_v2", transfers, self._get_groups)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix of `keys` over the KV pool and the side pools' hit policies (as
        SGLang's MooncakeStore decides it): ALL_PAGES pools must hold every page of it,
        TRAILING_PAGES pools the last len(transfer.keys) pages before a stop point."""
        return self._guard(
            "batch_exists_v2", PoolTransferResult(0, {}, []), lambda: self._exists_v2(keys, pool_transfers)
        )

    def _exists_v2(self, keys: list[str], transfers: list[PoolTransfer] | None) -> PoolTransferResult:
        anchor = getattr(self.mem_pool_host, "kv_buffer", None)
        kv_pages = len(keys) if anchor is None else _leading(self._exist_pages(keys, ""))
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        transfers = transfers or []
        objects = [self.keys.page_objects(keys[:kv_pages], str(t.name)) for t in transfers]
        flat = self._client.batch_exists([o for group in objects for o in group]) if restorable else []
        start = 0
        for transfer, group in zip(transfers, objects, strict=True):
            present = self._complete(flat[start : start + len(group)])
            start += len(group)
            stops = _stop_points(transfer, present)
            if stops:
                hits[transfer.name] = max(stops)
            restorable = [n for n in restorable if n in stops]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _v2(
        self,
        op: str,
        transfers: list[PoolTransfer],
        run: Callable[[list[PageGroup]], list[list[bool]]],
    ) -> dict[str, list[bool]]:
        failed = {str(t.name): [False] * len(t.keys or []) for t in transfers}

        def go() -> dict[str, list[bool]]:
            groups = [self._group(t) for t in transfers]
            return {str(t.name): ok for t, ok in zip(transfers, run(groups), strict=True)}

        return self._guard(op, failed, go)

    def _group(self, transfer: PoolTransfer) -> PageGroup:
        name = str(transfer.name)
        if transfer.host_indices is None or not transfer.keys:
            raise InvalidArgument(f"pool {name}: a transfer needs keys and host_indices")
        if name == PoolName.KV:
            return PageGroup(transfer.keys, transfer.host_indices, self.mem_pool_host)
        if name not in self.registered_pools:
            raise InvalidArgument(f"pool {name} was never registered (register_mem_host_pool_v2)")
        return PageGroup(transfer.keys, transfer.host_indices, self.registered_pools[name], name)

    # -- the batches ----------------------------------------------------------------------

    def _set_groups(self, groups: list[PageGroup]) -> list[list[bool]]:
        """One exists batch over every object, then one put batch of the missing pages."""
        started = time.perf_counter()
        objects = [self.keys.page_objects(list(g.keys), g.pool_name) for g in groups]
        present = self._client.batch_exists([o for objs in objects for o in objs])
        items: list[tuple[str, Sequence[object]]] = []
        slots: list[tuple[int, int]] = []  # (group, page) of each put object
        done: list[list[bool]] = []
        start = 0
        for gi, (group, objs) in enumerate(zip(groups, objects, strict=True)):
            pages = self._complete(present[start : start + len(objs)])
            start += len(objs)
            done.append(pages)
            missing = [i for i, ok in enumerate(pages) if not ok]
            if not missing:
                continue
            parts = self._parts(group, missing)
            m = self.keys.per_page
            for k, page in enumerate(missing):
                for j in range(m):
                    items.append((objs[page * m + j], parts[k * m + j]))
                    slots.append((gi, page))
        if items:
            stored = {(gi, page) for gi, page in slots}
            errors = self._client.batch_put_parts(items, self._config)
            failed = {slot for slot, e in zip(slots, errors, strict=True) if not _stored(e)}
            _log_first("put", [e for e in errors if not _stored(e)])
            for gi, page in stored - failed:
                done[gi][page] = True
            self._note("backup", len(stored), sum(_size(parts) for _, parts in items), started)
        return done

    def _get_groups(self, groups: list[PageGroup]) -> list[list[bool]]:
        """One get batch of every page, straight into the pools."""
        started = time.perf_counter()
        objects: list[str] = []
        parts: list[Sequence[object]] = []
        for group in groups:
            objects += self.keys.page_objects(list(group.keys), group.pool_name)
            parts += self._parts(group, range(len(group.keys)))
        results = self._client.batch_get_parts(objects, parts)
        _log_first("get", [r.error for r in results if r.error is not None])
        ok = [r.found and r.error is None for r in results]
        out: list[list[bool]] = []
        start = 0
        for group in groups:
            n = len(group.keys) * self.keys.per_page
            out.append(self._complete(ok[start : start + n]))
            start += n
        pages = sum(map(len, out))
        self._note("prefetch", pages, sum(r.size for r in results if r.found), started)
        return out

    def _exist_pages(self, keys: Sequence[str], pool_name: str) -> list[bool]:
        return self._complete(self._client.batch_exists(self.keys.page_objects(list(keys), pool_name)))

    def _complete(self, objects: Sequence[bool]) -> list[bool]:
        """Per page: whether all its `per_page` objects are."""
        m = self.keys.per_page
        return [all(objects[i : i + m]) for i in range(0, len(objects), m)]

    def _parts(self, group: PageGroup, pages: Sequence[int]) -> list[list[Part]]:
        """The (address, size) parts of each object of `pages` (indices into group.keys), from
        the pool's zero-copy metadata. Raises InvalidArgument when the pool's buffers do not
        split evenly into those objects."""
        count = len(group.keys)
        if count == 0 or group.host_indices.numel() % count:
            raise InvalidArgument(f"{group.host_indices.numel()} host indices for {count} pages")
        indices = group.host_indices
        if len(pages) < count:
            indices = indices.reshape(count, -1)[list(pages)].reshape(-1)
        if self.layout.split_factor and not group.pool_name:
            ptrs, sizes = group.pool.get_split_heads_page_buffer_meta(indices, self.layout.split_factor)  # type: ignore[attr-defined]
        else:
            ptrs, sizes = group.pool.get_page_buffer_meta(indices)  # type: ignore[attr-defined]
        n = len(pages) * self.keys.per_page
        if len(ptrs) != len(sizes) or len(ptrs) % n:
            raise InvalidArgument(f"pool {group.pool_name or 'kv'} gave {len(ptrs)} buffers for {n} objects")
        each = len(ptrs) // n
        pairs = [(int(a), int(b)) for a, b in zip(ptrs, sizes, strict=True)]
        return [pairs[i * each : (i + 1) * each] for i in range(n)]

    # -- legacy calls on (pointer, size) targets -------------------------------------------

    def get(self, key: str, target_location: object = None, target_sizes: object = None) -> object:
        """Read `key` into the target: a tensor (returned filled, or None on a miss), or a
        pointer and size, or lists of them (returns whether it was read)."""
        got = self.batch_get([key], [target_location], [target_sizes])
        return got[0] if isinstance(got, list) else got == 1

    def batch_get(
        self, keys: list[str], target_locations: object = None, target_sizes: object = None
    ) -> list[object] | int:
        """Read `keys` into their targets. Tensors (SGLang's generic path, `target_sizes`
        None): each target filled, or None where it was not read. Pointers: how many, from
        the first, were read."""
        tensors = target_sizes is None or all(size is None for size in _listed(target_sizes))

        def go() -> list[object] | int:
            targets = _targets(keys, target_locations, target_sizes)
            results = self._client.batch_get_parts([self.keys.raw(k) for k in keys], targets)
            _log_first("get", [r.error for r in results if r.error is not None])
            ok = [r.found and r.error is None for r in results]
            if tensors:
                return [t[0] if good else None for t, good in zip(targets, ok, strict=True)]
            return _leading(ok)

        failed: list[object] | int = [None] * len(keys) if tensors else 0
        return self._guard("batch_get", failed, go)

    def set(self, key: str, value: object = None, target_location: object = None, target_sizes: object = None) -> bool:
        """Store `key` from `value` (a buffer) or the target (pointer and size, or lists)."""
        locations = [value] if value is not None else [target_location]
        return self.batch_set([key], None, locations, None if value is not None else [target_sizes])

    def batch_set(
        self, keys: list[str], values: object = None, target_locations: object = None, target_sizes: object = None
    ) -> bool:
        """Store `keys` (skipping those stored already); whether all of them are stored."""

        def go() -> bool:
            sources = values if values is not None else target_locations
            targets = _targets(keys, sources, None if values is not None else target_sizes)
            raw = [self.keys.raw(k) for k in keys]
            present = self._client.batch_exists(raw)
            items = [(k, t) for k, t, there in zip(raw, targets, present, strict=True) if not there]
            errors = self._client.batch_put_parts(items, self._config) if items else []
            _log_first("put", [e for e in errors if not _stored(e)])
            return bool(keys) and all(_stored(e) for e in errors)

        return self._guard("batch_set", False, go)

    def exists(self, key: str) -> bool:
        """Whether the legacy object `key` is stored."""
        return self._guard("exists", False, lambda: self._client.exists(self.keys.raw(key)))

    # -- admin -----------------------------------------------------------------------------

    def clear(self) -> bool:
        """Remove this model's objects (every rank's) from the pool; whether that worked."""
        pattern = f"^{re.escape(f'sglang/{self.keys.model}/')}"
        return self._guard("clear", False, lambda: self._client.remove_matching(pattern, force=True) >= 0)

    def get_stats(self) -> StorageMetrics | None:
        """Pages and GB/s of the backups (puts) and prefetches (gets) since the last call, when
        SGLang enabled storage metrics; else None."""
        if not self._metrics:
            return None
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(self._pages["prefetch"])
        metrics.backup_pgs.extend(self._pages["backup"])
        metrics.prefetch_bandwidth.extend(self._gbps["prefetch"])
        metrics.backup_bandwidth.extend(self._gbps["backup"])
        for kind in ("prefetch", "backup"):
            self._pages[kind].clear()
            self._gbps[kind].clear()
        return metrics

    def close(self) -> None:
        """Close the store client (its segment leaves the pool)."""
        self._client.close()

    # -- plumbing ----------------------------------------------------------------------------

    def _note(self, kind: str, pages: int, nbytes: int, started: float) -> None:
        if self._metrics and pages:
            self._pages[kind].append(pages)
            self._gbps[kind].append(nbytes / max(time.perf_counter() - started, 1e-9) / 1e9)

    @staticmethod
    def _guard(op: str, failed: T, run: Callable[[], T]) -> T:
        """`run()`, or `failed` after one log line: nothing escapes into SGLang."""
        try:
            return run()
        except TsukimiError as exc:
            logger.error("tsukimi hicache %s failed: %s", op, exc)
        except Exception:  # NOTE: a pool's metadata or a bad argument must not kill the controller
            logger.exception("tsukimi hicache %s failed", op)
        return failed


def _stored(error: TsukimiError | None) -> bool:
    """A put succeeded, or found the object there already (another rank or call stored it)."""
    return error is None or isinstance(error, ObjectExists)


def _leading(flags: Sequence[bool]) -> int:
    """How many of `flags`, from the first, are True. Pure."""
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


def _size(parts: Sequence[object]) -> int:
    return sum(part[1] for part in parts if isinstance(part, tuple))


def _log_first(op: str, errors: Sequence[TsukimiError | None]) -> None:
    """One log line for a batch's failed objects: how many, and the first error."""
    failed = [e for e in errors if e is not None]
    if failed:
        logger.error("tsukimi hicache: %d object %ss failed, first: %s", len(failed), op, failed[0])


def _stop_points(transfer: PoolTransfer, present: list[bool]) -> list[int]:
    """The prefix lengths (1..len(present)) a side pool can serve under its hit policy.
    Raises InvalidArgument for a policy this backend does not serve (BLOCK_GROUPS)."""
    if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
        return list(range(1, _leading(present) + 1))
    if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
        window = max(1, len(transfer.keys or []))
        return [n for n in range(1, len(present) + 1) if all(present[max(0, n - window) : n])]
    raise InvalidArgument(f"hit policy {transfer.hit_policy} is not served by tsukimi's HiCache backend")


def _listed(value: object) -> list[object]:
    """`value` as a list (a non-sequence, e.g. one size, as a list of itself). Pure."""
    return list(value) if isinstance(value, Sequence) else [value]


def _targets(keys: Sequence[str], locations: object, sizes: object) -> list[Sequence[object]]:
    """Each legacy key's parts: a buffer (tensor), (pointer, size), or lists of pointers and
    sizes. Raises InvalidArgument for anything else."""
    if not isinstance(locations, Sequence) or len(locations) != len(keys):
        raise InvalidArgument(f"{len(keys)} keys need as many targets")
    each_size = sizes if isinstance(sizes, Sequence) else [None] * len(keys)
    out: list[Sequence[object]] = []
    for location, size in zip(locations, each_size, strict=True):
        if isinstance(location, int) and isinstance(size, int):
            out.append([(location, size)])
        elif isinstance(location, Sequence) and isinstance(size, Sequence):
            out.append([(int(a), int(b)) for a, b in zip(location, size, strict=True)])
        elif location is not None and size is None:
            out.append([location])
        else:
            raise InvalidArgument(f"cannot use a {type(location).__name__} target of size {size!r}")
    return out
