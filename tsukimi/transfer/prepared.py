"""Prepared transfers: requests validated and routed once, then posted again and again, as
NIXL's prepared handles are (a connector that moves the same layout of KV blocks every step,
a benchmark loop).

`TransferEngine.prepare(requests)` returns a `PreparedTransfer`; `run()` moves the requests
and returns their statuses, like `transfer`. When every request goes to one peer over one
transport that can prepare them (`Preparable`: the cma transport builds its iovec lists
once, the shm transport finds both addresses of every copy once), `run()` is that
transport's prepared call, with the statuses built once; when the call
reports anything but complete success, or there is no prepared call, `run()` is an ordinary
`transfer` of the same requests, which says what went wrong.

`transfer`/`submit` take this path by themselves for a list of requests they saw before
(tsukimi/transfer/plan_memo.py); `prepare` remains for a caller that wants it explicit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tsukimi.clock import Clock
from tsukimi.transfer.batch import RequestState, RequestStatus, TransferRequest

Transfer = Callable[[Sequence[TransferRequest], float | None], list[RequestStatus]]


class PreparedTransfer:
    """Requests ready to run many times (see the module). Keeps their buffers alive."""

    def __init__(
        self,
        requests: Sequence[TransferRequest],
        sizes: Sequence[int],
        timeout_s: float,
        transfer: Transfer,
        fast: Callable[[float], bool] | None,
        clock: Clock,
    ) -> None:
        self.requests = list(requests)
        self._timeout_s, self._transfer, self._fast, self._clock = timeout_s, transfer, fast, clock
        self._completed = [RequestStatus(RequestState.COMPLETED, size) for size in sizes]

    @property
    def fast(self) -> bool:
        """Whether a transport prepared the requests (else every run is an ordinary transfer)."""
        return self._fast is not None

    def run(self) -> list[RequestStatus]:
        """Move the requests now; their final statuses, by the run's deadline (the prepared
        call's time left goes to the ordinary transfer that redoes it). Raises what
        `transfer` raises."""
        if self._fast is None:
            return self._transfer(self.requests, self._timeout_s)
        deadline = self._clock.now() + self._timeout_s
        try:
            moved = self._fast(self._timeout_s)
        except (OSError, ValueError):  # NOTE: the transport was closed under it
            moved = False
        if moved:
            return list(self._completed)
        return self._transfer(self.requests, max(0.0, deadline - self._clock.now()))
