"""The router's side of queue, then reject: requests the Conductor queued (`Decision.queued`)
for decode KV memory or for the TBT SLO, at arrival or after their prefill, each await their
release here.

    schedule -> queued ----------------------> wait(): the future of its release
    admit_decode(wait=True) -> queued -------> wait_at_decode(): the same, after prefill
    decode_finished / finished_at_prefill /    wake(): Conductor.release(now) -> each released
    rejection / cancel (memory freed,                  request's future gets its Decision
    a decode batch shrunk)

A waiter is bounded by its deadline (arrival + the TTFT SLO): past it, it leaves the queue and
is rejected ("ttft_slo", saying it waited longer than predicted), so no request is stranded;
a client that disconnects (the task cancelled) leaves the queue too, or gives back its
booking when it was released at that moment. Runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container

from tsukimi.clock import Clock
from tsukimi.errors import Rejected
from tsukimi.scheduler.conductor import Conductor, Decision

logger = logging.getLogger(__name__)


class ReleaseWaits:
    """The queued requests' futures, by request id; not thread-safe (one event loop)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._futures: dict[int, asyncio.Future[Decision]] = {}

    def wake(self, conductor: Conductor, exclude: Container[str] = ()) -> None:
        """Releases what the Conductor can place now and hands each waiter its decision
        (mutates). Call after every event that frees decode KV memory."""
        now = self.clock.now()
        for decision in conductor.release(now, exclude):
            future = self._futures.pop(decision.request_id, None)
            if future is None or future.done():  # NOTE: nobody waits for it any more: give it back
                conductor.finished_at_prefill(decision.request_id, now)
                continue
            future.set_result(decision)

    async def wait(
        self, conductor: Conductor, queued: Decision, deadline_s: float, forbidden: Callable[[], Container[str]]
    ) -> Decision | None:
        """The decision that places `queued` once released (on this clock, by `deadline_s`);
        None when it was released onto a worker in `forbidden()` (down now, or a CPP group for
        a sampling request): its booking is given back, and the caller schedules it again.

        Raises:
            Rejected: the deadline passed first ("ttft_slo"; it left the queue).
        """
        decision = await self._wait(conductor, queued, deadline_s)
        if decision.prefill in forbidden():
            conductor.finished_at_prefill(decision.request_id, self.clock.now())
            self.wake(conductor)
            return None
        return decision

    async def wait_at_decode(self, conductor: Conductor, queued: Decision, deadline_s: float) -> Decision:
        """The decision that places `queued`, a prefilled request waiting for a place in its
        decode instance's batch (`Conductor.admit_decode(..., wait=True)`), by `deadline_s`.

        Raises:
            Rejected: the deadline passed first ("ttft_slo"; it left the queue and its booking).
        """
        return await self._wait(conductor, queued, deadline_s)

    async def _wait(self, conductor: Conductor, queued: Decision, deadline_s: float) -> Decision:
        rid = queued.request_id
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._futures[rid] = future
        try:
            timeout = max(0.0, deadline_s - self.clock.now())
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            if not conductor.cancel(rid):  # NOTE: released just now: it goes on
                return future.result()
            self.wake(conductor)
            why = f"waited past the TTFT deadline ({queued.message})"
            raise Rejected("ttft_slo", why) from None
        except BaseException:
            if not conductor.cancel(rid) and future.done():  # released, then its client left
                conductor.finished_at_prefill(rid, self.clock.now())
            self.wake(conductor)
            raise
        finally:
            self._futures.pop(rid, None)
