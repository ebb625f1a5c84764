"""The Conductor's books under queue, then reject (`kv_wait`), as a Hypothesis state machine:
requests arrive, finish prefill (going on to decode, waiting there for the TBT SLO, finishing at
prefill or rejected), leave decode, and are cancelled while queued, in any order a caller may
drive them, with `release` after each event as the router and the simulator call it.

Invariants after every step: each request the Conductor knows is in exactly one state (queued
at arrival, in prefill, on its way to or in decode, queued at decode); the KV ledger's
reservations belong to booked requests only; the queue is in arrival order; an instance's
context-token sum is its batch's. Once every request has left, the books are empty."""

from __future__ import annotations

import dataclasses

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tsukimi.config import ROUTER_CONDUCTOR
from tsukimi.scheduler.conductor import Conductor, Decision, ScheduleRequest
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.scheduler.prefix_index import PrefixIndex
from tsukimi.scheduler.service_term import ServiceTerm

# NOTE: 10 ms + 1 ms per request under a 12.5 ms TBT SLO: two at a time per decode instance;
# 3,000 KV tokens each: two or three of these requests
COST = LinearCostModel(prefill_coef=(0.0, 1e-4, 0.0), decode_coef=(0.01, 1e-3, 0.0), kv_bytes_per_token=1)


class ConductorBooks(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        config = dataclasses.replace(ROUTER_CONDUCTOR, block_tokens=100, tbt_slo_s=0.0125, ttft_slo_s=20.0)
        self.conductor = Conductor(config, COST, PrefixIndex(), ["p0", "p1"], ["d0", "d1"], 3000)
        self.conductor.service = ServiceTerm()
        self.now = 0.0
        self.next_id = 0
        self.queued: set[int] = set()  # queued at arrival
        self.prefilling: set[int] = set()
        self.decoding: set[int] = set()
        self.waiting_at_decode: set[int] = set()

    def _released(self, decisions: list[Decision]) -> None:
        for d in decisions:
            assert d.accepted and d.queued
            if d.request_id in self.waiting_at_decode:
                self.waiting_at_decode.remove(d.request_id)
                self.decoding.add(d.request_id)
            else:
                self.queued.remove(d.request_id)
                self.prefilling.add(d.request_id)

    def _release(self) -> None:
        self._released(self.conductor.release(self.now))

    @rule(tokens=st.integers(1, 1500), max_tokens=st.sampled_from([0, 16, 200]), dt=st.floats(0, 0.5))
    def arrive(self, tokens: int, max_tokens: int, dt: float) -> None:
        self.now += dt
        rid, self.next_id = self.next_id, self.next_id + 1
        decision = self.conductor.schedule(ScheduleRequest(rid, tokens, [], max_tokens), self.now)
        event(f"arrival: {'queued' if decision.queued else decision.reason or 'placed'}")
        if decision.accepted:
            (self.queued if decision.queued else self.prefilling).add(rid)
        else:
            assert decision.reason and decision.message  # NOTE: a 429 says why

    @precondition(lambda self: self.prefilling)
    @rule(data=st.data(), dt=st.floats(0, 1.0), only_token=st.booleans())
    def prefill_done(self, data: st.DataObject, dt: float, only_token: bool) -> None:
        self.now += dt
        rid = data.draw(st.sampled_from(sorted(self.prefilling)))
        self.prefilling.remove(rid)
        if only_token:
            self.conductor.finished_at_prefill(rid, self.now)
        else:
            answer = self.conductor.admit_decode(rid, self.now, wait=True)
            waits = isinstance(answer, Decision) and answer.accepted
            event(f"at decode: {'placed' if isinstance(answer, str) else 'queued' if waits else 'rejected'}")
            if isinstance(answer, str):
                self.decoding.add(rid)
            elif isinstance(answer, Decision) and answer.accepted:
                assert answer.queued
                self.waiting_at_decode.add(rid)
        self._release()

    @precondition(lambda self: self.decoding)
    @rule(data=st.data(), dt=st.floats(0, 2.0))
    def decode_done(self, data: st.DataObject, dt: float) -> None:
        self.now += dt
        rid = data.draw(st.sampled_from(sorted(self.decoding)))
        self.decoding.remove(rid)
        self.conductor.decode_finished(rid, self.now, 16)
        self._release()

    @precondition(lambda self: self.queued or self.waiting_at_decode)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.queued | self.waiting_at_decode)))
        assert self.conductor.cancel(rid)
        self.queued.discard(rid)
        self.waiting_at_decode.discard(rid)
        self._release()

    @rule(dt=st.floats(0, 1.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._release()

    @invariant()
    def each_request_is_in_one_state(self) -> None:
        c = self.conductor
        states = (self.queued, self.prefilling, self.decoding, self.waiting_at_decode)
        assert sum(map(len, states)) == len(set().union(*states))
        queue = list(c._kv.queue)
        assert {q.request_id for q in queue if not q.at_decode} == self.queued == set(c._waiting)
        assert {q.request_id for q in queue if q.at_decode} == self.waiting_at_decode
        assert set(c._requests) == self.prefilling | self.decoding | self.waiting_at_decode
        active = {rid for load in c._decode.values() for rid in load.active}
        assert active == self.decoding
        incoming = {rid for load in c._decode.values() for rid in load.incoming}
        assert self.waiting_at_decode <= incoming <= self.prefilling | self.waiting_at_decode
        assert set(c._kv.reserved) <= set(c._requests)
        assert [q.arrived_s for q in queue] == sorted(q.arrived_s for q in queue)
        for load in c._decode.values():
            assert load.active_tokens == sum(tokens for _, tokens in load.active.values())
        jobs = {rid for load in c._prefill.values() for rid in load.jobs}
        assert jobs == self.prefilling and jobs == {rid for load in c._prefill.values() for rid in load.started}

    def teardown(self) -> None:
        # NOTE: everyone leaves: the queued are cancelled, the rest finish; the books end empty
        c = self.conductor
        for rid in sorted(self.queued | self.waiting_at_decode):
            assert c.cancel(rid)
        for rid in sorted(self.prefilling):
            c.finished_at_prefill(rid, self.now)
        for rid in sorted(self.decoding):
            c.decode_finished(rid, self.now, 16)
        assert c.release(self.now) == [] and c.queued == 0
        assert not c._requests and not c._kv.reserved and not c._waiting and not c._arrived
        assert all(not load.active and not load.incoming and not load.active_tokens for load in c._decode.values())
        assert all(not load.jobs and not load.started for load in c._prefill.values())


TestConductorBooks = ConductorBooks.TestCase
TestConductorBooks.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
