"""`PutPath`: how a store client puts objects, a part of client.py's `StoreClient`.

    PutStart (the master places the replicas)
      -> WRITE every replica of every started put, in one Transfer Engine batch (replica_io.py)
      -> PutEnd where every replica was written, PutRevoke where one was not

Puts go `p.MAX_BATCH` per round trip. A put the master refused with OffloadPending (memory is
being copied to a holder's disk to make room) is put again, backing off, for up to
`client.put_wait_s`. A started put is never left pending: when the writes raise, it is
revoked before the exception goes on. A put the master reclaimed before its PutEnd (its writes
took longer than `master.put_timeout_s`) fails as a TransferError, never as ObjectNotFound.

The same steps, split for a writer that fills an object over several calls (a layer-wise KV
writer, Mooncake's put sessions):

    start([Reservation(key, size, config)])   -> OpenPut (the replicas), or the error
    write([RangeWrite(open_put, offset, src)]) -> WRITE src at offset of every replica (one batch)
    end([open_put]) / revoke([open_put])       -> PutEnd (readable) / PutRevoke

Nothing is checksummed (the value is never whole on the writer's side), and the caller owns
the open puts: it must end or revoke each within `master.put_timeout_s` of its start, or the
master reclaims it and its `end` fails with a TransferError.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tsukimi.clock import Clock
from tsukimi.config import ClientConfig
from tsukimi.errors import InvalidArgument, ObjectNotFound, OffloadPending, TransferError, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.local_replicas import gather, local_view
from tsukimi.store.master_batch import call_batch
from tsukimi.store.master_link import MasterLink
from tsukimi.store.replica_io import PutItem, transfer_error, write_replicas
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.segment import byte_view

DEFAULT_PUT_TIMEOUT_S = 30.0  # a master that does not say how long it keeps a put: MasterConfig's default
_FIRST_WAIT_S = 0.002
_MAX_WAIT_S = 0.05
_Item = TypeVar("_Item")
_Outcome = TypeVar("_Outcome")


@dataclass(frozen=True, slots=True)
class Reservation:
    """An object to start putting without its bytes: `size` bytes under `key`."""

    key: str
    size: int
    config: p.ReplicaConfig


@dataclass(frozen=True, slots=True)
class OpenPut:
    """A started put: where its replicas are, until it is ended or revoked, or until
    `deadline` (the client's clock): the master reclaims it then, and its blocks may hold
    another object later, so no write goes to them after it."""

    key: str
    size: int
    put_id: int
    replicas: tuple[p.ReplicaLocation, ...]
    deadline: float = float("inf")

    def expired(self, now: float) -> bool:
        """Whether the master may have reclaimed this put by `now`."""
        return now >= self.deadline


@dataclass(frozen=True, slots=True)
class RangeWrite:
    """Write `source` (any readable buffer, or an (address, length) tuple) at byte `offset`
    of every replica of `put`."""

    put: OpenPut
    offset: int
    source: object


class PutPath:
    """The puts of one client (`client_id`). Keeps no state of its own between calls, so it is
    as thread-safe as the link and the engine it is given."""

    def __init__(
        self, client_id: str, link: MasterLink, engine: TransferEngine, clock: Clock, config: ClientConfig
    ) -> None:
        """`config`: the client's settings (`checksum`, `put_wait_s`)."""
        self._client_id = client_id
        self._link = link
        self._engine = engine
        self._clock = clock
        self._checksum = config.checksum
        self._wait_s = config.put_wait_s

    def put(self, puts: Sequence[PutItem]) -> list[TsukimiError | None]:
        """Put every item (see the module). Mutates the store.

        Returns:
            Each item's error, or None where it was stored: ObjectExists, OutOfSpace,
            TransferError (a replica write failed; the put was revoked), InvalidArgument, ...
        Raises:
            Only for the whole call: RpcTimeout / MasterUnavailable.
        """
        errors: list[TsukimiError | None] = []
        for start in range(0, len(puts), p.MAX_BATCH):
            errors += self._put_waiting(list(puts[start : start + p.MAX_BATCH]))
        return errors

    def _put_waiting(self, puts: list[PutItem]) -> list[TsukimiError | None]:
        """`_put_chunk`, putting again the objects refused while memory was being copied to
        disk to make room (`_waiting`)."""
        return self._waiting(self._put_chunk, puts)

    def _waiting(self, run: Callable[[list[_Item]], list[_Outcome]], items: list[_Item]) -> list[_Outcome]:
        """`run(items)`, running again for up to `put_wait_s` the items refused with
        OffloadPending (memory was being copied to disk to make room)."""
        outcomes = run(items)
        deadline, delay_s = self._clock.now() + self._wait_s, _FIRST_WAIT_S
        while True:
            waiting = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, OffloadPending)]
            if not waiting or self._clock.now() + delay_s > deadline:
                return outcomes
            self._clock.sleep(delay_s)
            delay_s = min(2 * delay_s, _MAX_WAIT_S)
            for i, outcome in zip(waiting, run([items[i] for i in waiting]), strict=True):
                outcomes[i] = outcome

    def _put_chunk(self, puts: list[PutItem]) -> list[TsukimiError | None]:
        starts = [
            p.PutStart(
                self._client_id,
                u.key,
                u.size,
                u.config,
                u.upsert,
                _new_put_id(),
                u.crc32c() if self._checksum else None,
            )
            for u in puts
        ]
        started = call_batch(self._link, starts)
        errors: list[TsukimiError | None] = [_error(r) for r in started]
        written = False
        try:
            write_replicas(self._engine, puts, started, errors)
            written = True
        finally:  # NOTE: even when the writes raised, never leave a started put pending
            if not written:
                for i, result in enumerate(started):
                    if isinstance(result, p.PutStartResult):
                        errors[i] = errors[i] or TransferError(f"writing {puts[i].key!r} was interrupted")
            self._end_puts(puts, started, errors)
        return errors

    def _end_puts(
        self, puts: list[PutItem], started: list[p.BatchResultItem], errors: list[TsukimiError | None]
    ) -> None:
        """PutEnd where every replica was written, PutRevoke elsewhere (mutates `errors`)."""
        live = [i for i, r in enumerate(started) if isinstance(r, p.PutStartResult)]
        ends: list[p.PutEnd | p.PutRevoke] = []
        for i in live:
            result = started[i]
            assert isinstance(result, p.PutStartResult)
            end = p.PutEnd if errors[i] is None else p.PutRevoke
            ends.append(end(self._client_id, puts[i].key, result.put_id))
        try:
            ended = call_batch(self._link, ends)
        except TsukimiError as exc:  # ambiguous: the master may or may not have applied them
            for i in live:
                errors[i] = errors[i] or exc
            return
        for i, result in zip(live, ended, strict=True):
            errors[i] = errors[i] or _end_error(puts[i].key, result)

    # -- the same steps, split (see the module) ------------------------------------------

    def start(self, reservations: Sequence[Reservation]) -> list[OpenPut | TsukimiError]:
        """PutStart for every reservation (no bytes are moved). Mutates the store: the caller
        must `end` or `revoke` every OpenPut returned.

        Returns:
            Each reservation's OpenPut, or its error: ObjectExists, OutOfSpace,
            InvalidArgument, ...
        Raises:
            Only for the whole call: RpcTimeout / MasterUnavailable (puts started in an
            earlier chunk of the call are then left for the master to reclaim).
        """
        outcomes: list[OpenPut | TsukimiError] = []
        for start in range(0, len(reservations), p.MAX_BATCH):
            outcomes += self._waiting(self._start_chunk, list(reservations[start : start + p.MAX_BATCH]))
        return outcomes

    def _start_chunk(self, reservations: list[Reservation]) -> list[OpenPut | TsukimiError]:
        starts = [p.PutStart(self._client_id, r.key, r.size, r.config, False, _new_put_id()) for r in reservations]
        outcomes: list[OpenPut | TsukimiError] = []
        sent = self._clock.now()  # NOTE: the master's timeout counts from before its answer came
        for r, result in zip(reservations, call_batch(self._link, starts), strict=True):
            if isinstance(result, p.PutStartResult):
                timeout_s = result.timeout_s or DEFAULT_PUT_TIMEOUT_S
                outcomes.append(OpenPut(r.key, r.size, result.put_id, tuple(result.replicas), sent + timeout_s))
            else:
                outcomes.append(_error(result) or TransferError(f"no replicas for {r.key!r}"))
        return outcomes

    def write(self, writes: Sequence[RangeWrite]) -> list[TsukimiError | None]:
        """WRITE every range to every replica of its put, in one Transfer Engine batch.

        Returns:
            Each write's error, or None: InvalidArgument (a range outside the object),
            InvalidBufferError (a source that is not a buffer), TransferError (a replica
            write failed; the put stays open: write again, or revoke it).
        """
        errors: list[TsukimiError | None] = [None] * len(writes)
        requests: list[TransferRequest] = []
        owners: list[int] = []
        now = self._clock.now()
        for i, write in enumerate(writes):
            if write.put.expired(now):
                errors[i] = TransferError(
                    f"the put of {write.put.key!r} outlived the master's put timeout: it may be reclaimed,"
                    " so nothing more is written to it (start it again)"
                )
                continue
            try:
                view = byte_view(write.source, writable=False, with_address=False)[0]
                if not isinstance(write.offset, int) or write.offset < 0 or write.offset + len(view) > write.put.size:
                    raise InvalidArgument(
                        f"bytes [{write.offset}, {write.offset}+{len(view)}) are outside"
                        f" {write.put.key!r} ({write.put.size} bytes)"
                    )
            except TsukimiError as exc:
                errors[i] = exc
                continue
            for loc in write.put.replicas:
                mine = local_view(self._engine, loc.te_segment, loc.address + write.offset, len(view))
                if mine is not None:  # in our own segment: a memcpy (local_replicas.py)
                    gather([view], mine)
                    continue
                requests.append(TransferRequest(OpCode.WRITE, loc.te_segment, loc.address + write.offset, view))
                owners.append(i)
        statuses = self._engine.transfer(requests) if requests else []
        for i, status in zip(owners, statuses, strict=True):
            if status.state is not RequestState.COMPLETED and errors[i] is None:
                errors[i] = transfer_error(status, f"writing a range of {writes[i].put.key!r}")
        return errors

    def end(self, puts: Sequence[OpenPut]) -> list[TsukimiError | None]:
        """PutEnd: the objects become readable. Each put's error, or None: a TransferError
        when the master had reclaimed it (see the module). Raises only for the whole call
        (RpcTimeout / MasterUnavailable: the master may or may not have ended them)."""
        return self._finish(p.PutEnd, puts)

    def revoke(self, puts: Sequence[OpenPut]) -> list[TsukimiError | None]:
        """PutRevoke: the objects are dropped. Each put's error, or None. Raises only for the
        whole call (RpcTimeout / MasterUnavailable)."""
        return self._finish(p.PutRevoke, puts)

    def _finish(self, op: type[p.PutEnd] | type[p.PutRevoke], puts: Sequence[OpenPut]) -> list[TsukimiError | None]:
        errors: list[TsukimiError | None] = []
        for start in range(0, len(puts), p.MAX_BATCH):
            chunk = puts[start : start + p.MAX_BATCH]
            ended = call_batch(self._link, [op(self._client_id, u.key, u.put_id) for u in chunk])
            errors += [_end_error(u.key, result) for u, result in zip(chunk, ended, strict=True)]
        return errors


def _new_put_id() -> int:
    """A random non-zero put id: a PutStart retried after a lost reply is recognised as the same put."""
    return secrets.randbits(62) | 1


def _error(result: p.BatchResultItem) -> TsukimiError | None:
    return p.error_of(result) if isinstance(result, p.Failure) else None


def _end_error(key: str, result: p.BatchResultItem) -> TsukimiError | None:
    """The error of a PutEnd (or PutRevoke) answer. A put the master no longer has in progress
    at PutEnd was reclaimed (its writes outlasted `master.put_timeout_s`, or a holder it
    wrote to was lost): not stored, a transfer that did not land in time, so a TransferError
    with the master's ObjectNotFound as its cause (the key itself was never missing)."""
    error = _error(result)
    if isinstance(error, ObjectNotFound):
        lost = TransferError(f"the put of {key!r} did not complete in time: the master gave it up ({error})")
        lost.__cause__ = error
        return lost
    return error
