"""`PutPath`: how a store client puts objects, a part of client.py's `StoreClient`.

    PutStart (the master places the replicas)
      -> WRITE every replica of every started put, in one Transfer Engine batch (replica_io.py)
      -> PutEnd where every replica was written, PutRevoke where one was not

Puts go `p.MAX_BATCH` per round trip. A put the master refused with OffloadPending (memory is
being copied to a holder's disk to make room) is put again, backing off, for up to
`client.put_wait_s`. A started put is never left pending: when the writes raise, it is
revoked before the exception goes on. A put the master reclaimed before its PutEnd (its writes
took longer than `master.put_timeout_s`) fails as a TransferError, never as ObjectNotFound.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from tsukimi.clock import Clock
from tsukimi.config import ClientConfig
from tsukimi.errors import ObjectNotFound, OffloadPending, TransferError, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.master_batch import call_batch
from tsukimi.store.master_link import MasterLink
from tsukimi.store.replica_io import PutItem, write_replicas
from tsukimi.transfer import TransferEngine

_FIRST_WAIT_S = 0.002
_MAX_WAIT_S = 0.05


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
        """`_put_chunk`, putting again for up to `put_wait_s` the objects refused while memory
        was being copied to disk to make room (OffloadPending)."""
        errors = self._put_chunk(puts)
        deadline, delay_s = self._clock.now() + self._wait_s, _FIRST_WAIT_S
        while True:
            waiting = [i for i, error in enumerate(errors) if isinstance(error, OffloadPending)]
            if not waiting or self._clock.now() + delay_s > deadline:
                return errors
            self._clock.sleep(delay_s)
            delay_s = min(2 * delay_s, _MAX_WAIT_S)
            for i, error in zip(waiting, self._put_chunk([puts[i] for i in waiting]), strict=True):
                errors[i] = error

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
