"""Mooncake's put and get sessions (`GetSessions`, `PutSessions`): an object read or written in
byte ranges over many calls, one call per model layer (SGLang's direct linker, vLLM-Ascend's
layer-wise store), with the master asked once per object, not once per call.

    get:  batch_get_session_start(keys)            GetReplicas once (a read lease), kept per key
          batch_get_into_multi_buffer_ranges(...)  per layer: one Transfer Engine batch, no master
          batch_get_session_end(keys)              drops what was kept (local)
    put:  batch_put_session_start(keys, sizes)     PutStart: the objects are reserved, not readable
          batch_put_from_multi_buffer_ranges(...)  per layer: WRITE every range to every replica
          batch_put_session_end(keys)              PutEnd: readable (or ..._revoke: PutRevoke)

A ranges call takes, per key, parallel lists of buffer addresses, sizes and offsets in the
object: fragment j of key i moves `sizes[i][j]` bytes between `ptrs[i][j]` and byte
`offsets[i][j]` of the object. It answers, per key, the bytes moved (the sum of its sizes) or
a negative code.

Codes, as mooncake-transfer-engine-non-cuda 0.3.13.post1 answers them (probed against its
`mooncake_master`): lists of different lengths fail every key with -600, a key whose own
lists differ in length -600; a key with no session -600 (a get session that was never
started, or whose start failed; a put session ended, revoked or never started); a fragment
past the object's end -600 for its key, and nothing of that key moves; a get session whose
lease ran out -707, once (the session is dropped, so the next call is -600); a put ranges
call with no fragment for a key -702. A second put start for a key with an open put session
is -600, a put start for an existing object -705, a size of 0 -600; a get start for a missing
key -704, again for a started key 0 (it looks the key up afresh). `batch_get_session_end`
answers 0 whatever the keys. Buffers need not be registered (as in the wheel, over TCP);
device memory (GPU) is staged through the client's host staging, one copy per call and
device, as the other zero-copy calls do. Where tsukimi differs: a get start on an object
still being put is -704 (the wheel: -703).

A get session keeps a share of the read lease the master granted (`Located.lease_end`,
tsukimi/store/ranges.py): the master's `lease_ttl_s` (Mooncake's `default_kv_lease_ttl`)
bounds how long a reader may take from start to its last layer. A put session must end
within the master's `put_timeout_s` (Mooncake's `put_start_discard_timeout_sec`) of its
start, or the master reclaims it and its end fails with -800; tsukimi's PutStart takes no
longer deadline, so a layer-wise writer keeps a whole object's layers under that.

Sessions belong to the client that started them: `clear()` (the store's close and re-setup)
revokes the open puts and forgets everything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tsukimi.clock import Clock, WallClock
from tsukimi.compat.mooncake.buffers import memory_at
from tsukimi.compat.mooncake.codes import (
    INVALID_PARAMS,
    INVALID_REPLICA,
    LEASE_EXPIRED,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    code_of,
)
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.compat.mooncake.replicate import ReplicateConfig
from tsukimi.device import DeviceRange
from tsukimi.errors import InvalidBufferError, TsukimiError
from tsukimi.store.puts import OpenPut, RangeWrite, Reservation
from tsukimi.store.ranges import Located, Lookup, RangeRead

logger = logging.getLogger(__name__)

Fragments = list[list[int]]  # per key, per fragment: an address, a size or an offset


@dataclass(frozen=True, slots=True)
class _Fragment:
    """`size` bytes between `memory` (device memory, or the (address, size) host buffer) and
    byte `offset` of the object."""

    memory: DeviceRange | tuple[int, int]
    size: int
    offset: int


SWEEP_AT = 65536  # open get sessions past which the expired ones are dropped at the next start


class GetSessions:
    """Get sessions: the replicas of each started key, read range by range (see the module).
    Thread-safe."""

    def __init__(self, connection: StoreConnection, clock: Clock | None = None) -> None:
        """`clock`: the client's (monotonic) clock, which lease ends are read against."""
        self._connection = connection
        self._clock = clock or WallClock()
        self._lock = threading.Lock()
        self._located: dict[str, Located] = {}

    def start(self, keys: list[str]) -> list[int]:
        """Look every key up once (a read lease) and keep its replicas: 0, or a negative code
        per key (-704 missing)."""
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        unique = list(dict.fromkeys(k for k in keys if isinstance(k, str)))
        try:
            lookups: dict[str, Lookup] = dict(zip(unique, client.locate(unique), strict=True))
        except TsukimiError as exc:
            logger.error("batch_get_session_start failed: %s", exc)
            return [code_of(exc)] * len(keys)
        now = self._clock.now()
        with self._lock:
            if len(self._located) > SWEEP_AT:  # NOTE: sessions a caller never ended, long expired
                self._located = {k: v for k, v in self._located.items() if not v.expired(now)}
            for key, found in lookups.items():
                if isinstance(found, Located):
                    self._located[key] = found
                else:
                    self._located.pop(key, None)
        codes = []
        for key in keys:
            if not isinstance(key, str):
                logger.error("batch_get_session_start: a key must be a str, got %r", key)
                codes.append(INVALID_PARAMS)
                continue
            found = lookups[key]
            if isinstance(found, TsukimiError):
                logger.error("get session %r: %s", key, found)
            codes.append(OK if isinstance(found, Located) else OBJECT_NOT_FOUND if found is None else code_of(found))
        return codes

    def read(self, keys: list[str], ptrs: Fragments, sizes: Fragments, offsets: Fragments) -> list[int]:
        """Read each key's fragments into their buffers, in one Transfer Engine batch: the
        bytes read, or a negative code per key (see the module)."""
        plan = _plan(keys, ptrs, sizes, offsets, "get")
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        now = self._clock.now()
        located: dict[str, Located] = {}
        reads: list[RangeRead] = []
        owners: list[int] = []
        codes = [code if isinstance(code, int) else 0 for code in plan]
        with self._lock:
            for i, (key, fragments) in enumerate(zip(keys, plan, strict=True)):
                if isinstance(fragments, int):
                    continue
                found = self._located.get(key)
                if found is None:
                    logger.error("batch_get_into_multi_buffer_ranges: no get session for %r", key)
                    codes[i] = INVALID_PARAMS
                elif found.expired(now):
                    logger.error("batch_get_into_multi_buffer_ranges: the get session of %r expired", key)
                    codes[i] = LEASE_EXPIRED
                    del self._located[key]
                elif not _fits(key, fragments, found.size):
                    codes[i] = INVALID_PARAMS
                else:
                    located[key] = found
                    for f in fragments:
                        if f.size:
                            reads.append(RangeRead(key, f.offset, f.memory))
                            owners.append(i)
                        codes[i] += f.size
        if not reads:
            return codes
        try:
            results = client.get_ranges_located(reads, located)
        except TsukimiError as exc:  # NOTE: located reads go to no master; this is the engine giving up
            logger.error("batch_get_into_multi_buffer_ranges failed: %s", exc)
            moving = set(owners)
            return [code_of(exc) if i in moving else code for i, code in enumerate(codes)]
        for i, result in zip(owners, results, strict=True):
            if codes[i] >= 0 and not result.found:
                logger.error("get range of %r: %s", keys[i], result.error)
                codes[i] = code_of(result.error) if result.error else OBJECT_NOT_FOUND
        return codes

    def end(self, keys: list[str]) -> int:
        """Forget the keys' sessions (local; keys with none are ignored): always 0."""
        with self._lock:
            for key in keys:
                self._located.pop(key, None)
        return OK

    def clear(self) -> None:
        """Forget every session (the client is going away)."""
        with self._lock:
            self._located.clear()


class PutSessions:
    """Put sessions: started puts, written range by range, then ended or revoked (see the
    module). Thread-safe."""

    def __init__(self, connection: StoreConnection, clock: Clock | None = None) -> None:
        """`clock`: the client's (monotonic) clock, which put deadlines are read against."""
        self._connection = connection
        self._clock = clock or WallClock()
        self._lock = threading.Lock()
        self._open: dict[str, OpenPut] = {}
        self._starting: set[str] = set()  # keys whose PutStart is on its way (a second start fails)

    def start(self, keys: list[str], sizes: list[int], config: ReplicateConfig | None) -> list[int]:
        """PutStart every key (`sizes[i]` bytes; nothing is written): 0, or a negative code
        per key (-705 the object exists, -600 a session is open for the key)."""
        if config is not None and not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
        if len(keys) != len(sizes):
            logger.error("batch_put_session_start: %d keys but %d sizes", len(keys), len(sizes))
            return [INVALID_PARAMS] * len(keys)
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        try:
            replicas = (config or ReplicateConfig()).per_key(len(keys), self._connection.hostname)
        except TsukimiError as exc:
            logger.error("batch_put_session_start: %s", exc)
            return [code_of(exc)] * len(keys)
        codes = [OK] * len(keys)
        slots: list[int] = []
        now = self._clock.now()
        with self._lock:
            for key in [k for k, put in self._open.items() if put.expired(now)]:
                # NOTE: the master has reclaimed it (or will): its key may be started afresh
                logger.warning("put session %r outlived the master's put timeout; forgotten", key)
                del self._open[key]
            for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                if not isinstance(key, str) or not isinstance(size, int) or size <= 0:
                    logger.error("batch_put_session_start: cannot reserve %r bytes for %r", size, key)
                    codes[i] = INVALID_PARAMS
                elif key in self._open or key in self._starting:
                    logger.error("batch_put_session_start: a put session of %r is open already", key)
                    codes[i] = INVALID_PARAMS
                else:
                    self._starting.add(key)
                    slots.append(i)
        try:
            started = client.start_puts([Reservation(keys[i], sizes[i], replicas[i]) for i in slots])
        except TsukimiError as exc:
            logger.error("batch_put_session_start failed: %s", exc)
            started = [exc] * len(slots)
        except BaseException:
            with self._lock:
                self._starting.difference_update(keys[i] for i in slots)
            raise
        with self._lock:  # NOTE: one block: no start of these keys slips between the two sets
            self._starting.difference_update(keys[i] for i in slots)
            for i, outcome in zip(slots, started, strict=True):
                if isinstance(outcome, OpenPut):
                    self._open[keys[i]] = outcome
                else:
                    logger.error("put session %r: %s", keys[i], outcome)
                    codes[i] = code_of(outcome)
        return codes

    def write(self, keys: list[str], ptrs: Fragments, sizes: Fragments, offsets: Fragments) -> list[int]:
        """Write each key's fragments to every replica of its open put, in one Transfer
        Engine batch: the bytes written, or a negative code per key (see the module)."""
        plan = _plan(keys, ptrs, sizes, offsets, "put")
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        writes: list[RangeWrite] = []
        owners: list[int] = []
        codes = [code if isinstance(code, int) else 0 for code in plan]
        with self._lock:
            for i, (key, fragments) in enumerate(zip(keys, plan, strict=True)):
                if isinstance(fragments, int):
                    continue
                put = self._open.get(key)
                if put is None:
                    logger.error("batch_put_from_multi_buffer_ranges: no put session for %r", key)
                    codes[i] = INVALID_PARAMS
                elif not fragments:
                    codes[i] = INVALID_REPLICA  # NOTE: what the wheel answers for a key with no fragment
                elif not _fits(key, fragments, put.size):
                    codes[i] = INVALID_PARAMS
                else:
                    for f in fragments:
                        if f.size:
                            writes.append(RangeWrite(put, f.offset, f.memory))
                            owners.append(i)
                        codes[i] += f.size
        if not writes:
            return codes
        try:
            errors = client.write_ranges(writes)
        except TsukimiError as exc:
            logger.error("batch_put_from_multi_buffer_ranges failed: %s", exc)
            moving = set(owners)
            return [code_of(exc) if i in moving else code for i, code in enumerate(codes)]
        for i, error in zip(owners, errors, strict=True):
            if codes[i] >= 0 and error is not None:
                logger.error("put range of %r: %s", keys[i], error)
                codes[i] = code_of(error)
        return codes

    def end(self, keys: list[str]) -> list[int]:
        """PutEnd every key's open put (the objects become readable): 0, or a negative code
        per key (-600 no session; -800 the master had reclaimed it)."""
        return self._finish(keys, revoke=False)

    def revoke(self, keys: list[str]) -> list[int]:
        """PutRevoke every key's open put: 0, or a negative code per key (-600 no session)."""
        return self._finish(keys, revoke=True)

    def clear(self) -> None:
        """Revoke every open put (best effort: the master reclaims what is left) and forget
        them all (the client is going away)."""
        with self._lock:
            puts = list(self._open.values())
            self._open.clear()
        client = self._connection.client
        if puts and client is not None:
            try:
                client.revoke_puts(puts)
            except TsukimiError as exc:
                logger.warning("revoking %d open put sessions: %s", len(puts), exc)

    def _finish(self, keys: list[str], revoke: bool) -> list[int]:
        what = "batch_put_session_revoke" if revoke else "batch_put_session_end"
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        codes = [OK] * len(keys)
        slots: list[int] = []
        puts: list[OpenPut] = []
        with self._lock:
            for i, key in enumerate(keys):
                put = self._open.pop(key, None) if isinstance(key, str) else None
                if put is None:
                    logger.error("%s: no put session for %r", what, key)
                    codes[i] = INVALID_PARAMS
                else:
                    slots.append(i)
                    puts.append(put)
        try:
            errors = client.revoke_puts(puts) if revoke else client.end_puts(puts)
        except TsukimiError as exc:  # NOTE: the master may or may not have applied them
            logger.error("%s failed: %s", what, exc)
            errors = [exc] * len(puts)
        for i, error in zip(slots, errors, strict=True):
            if error is not None:
                logger.error("%s %r: %s", what, keys[i], error)
            codes[i] = code_of(error)
        return codes


def _plan(
    keys: list[str], ptrs: Fragments, sizes: Fragments, offsets: Fragments, what: str
) -> list[list[_Fragment] | int]:
    """Each key's fragments, or INVALID_PARAMS for a key whose lists are unusable (every key
    when the outer lists differ in length)."""
    if not len(keys) == len(ptrs) == len(sizes) == len(offsets):
        lengths = (len(keys), len(ptrs), len(sizes), len(offsets))
        logger.error("%s ranges: %d keys, %d buffer, %d size, %d offset lists", what, *lengths)
        return [INVALID_PARAMS] * len(keys)
    plan: list[list[_Fragment] | int] = []
    for key, key_ptrs, key_sizes, key_offsets in zip(keys, ptrs, sizes, offsets, strict=True):
        try:
            plan.append(_fragments(key, key_ptrs, key_sizes, key_offsets))
        except (InvalidBufferError, TypeError) as exc:
            logger.error("%s ranges of %r: %s", what, key, exc)
            plan.append(INVALID_PARAMS)
    return plan


def _fragments(key: str, ptrs: Sequence[int], sizes: Sequence[int], offsets: Sequence[int]) -> list[_Fragment]:
    """Raises InvalidBufferError: lists of different lengths, a bad address, size or
    offset, device memory past its allocation; TypeError: not lists."""
    if not isinstance(key, str) or not len(ptrs) == len(sizes) == len(offsets):
        raise InvalidBufferError(f"{len(ptrs)} buffers, {len(sizes)} sizes, {len(offsets)} offsets")
    fragments = []
    for ptr, size, offset in zip(ptrs, sizes, offsets, strict=True):
        if not all(isinstance(v, int) for v in (ptr, size, offset)) or ptr <= 0 or size < 0 or offset < 0:
            raise InvalidBufferError(f"cannot move {size!r} bytes at {ptr!r} to offset {offset!r}")
        fragments.append(_Fragment(memory_at(ptr, size) if size else (ptr, size), size, offset))
    return fragments


def _fits(key: str, fragments: list[_Fragment], size: int) -> bool:
    """Whether every fragment lies inside the object's `size` bytes (logs the first that
    does not). Pure but for the log."""
    for f in fragments:
        if f.offset + f.size > size:
            logger.error("bytes [%d, %d) are outside %r (%d bytes)", f.offset, f.offset + f.size, key, size)
            return False
    return True
