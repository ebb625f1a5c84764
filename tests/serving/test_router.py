"""The router over FAKE workers (tiny FastAPI apps implementing the worker API
deterministically): colocated least-load placement, the PD flow through the Conductor
(the prefill worker makes one token by its role, decode with prompt + first token), rejections,
failing workers answered promptly with typed errors, the prefix index after prefill, and the
decision log keyed by the client's request id.

The fakes are tests/serving/fakes.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import pytest

from tests.serving.fakes import (
    BLOCK_TOKENS,
    FAST,
    PROMPT,
    FakeWorker,
    collect,
    dead_url,
    request,
    run_with,
    tokens,
)
from tsukimi.config import ROUTER_CONDUCTOR, ConductorConfig, RouterAppConfig, RouterConfig, load
from tsukimi.errors import (
    ConfigError,
    DuplicateRequest,
    InvalidArgument,
    Rejected,
    WorkerError,
    WorkerUnavailable,
)
from tsukimi.scheduler.block_hash import hash_blocks
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.serving.router.commands import add_parser, settings
from tsukimi.serving.router.router import Router, TokenEvent
from tsukimi.serving.router.workers import WorkerSpec, parse_workers

# -- configuration --------------------------------------------------------------------------


def test_parse_workers_and_modes() -> None:
    specs = parse_workers("p0=prefill@http://127.0.0.1:1/, d0 = decode@http://h:2")
    assert specs == [WorkerSpec("p0", "prefill", "http://127.0.0.1:1"), WorkerSpec("d0", "decode", "http://h:2")]
    assert Router(specs).mode == "pd"
    assert Router(parse_workers("a=colocated@http://h:1")).mode == "colocated"
    for bad in (
        "p0=prefill",
        "x=cook@http://h:1",
        "a=colocated@ftp://h",
        "a=colocated@http://h:1,a=decode@http://h:2",
        "",
        "pool=prefill@http://h:1",
    ):
        with pytest.raises(ConfigError):
            parse_workers(bad)
    with pytest.raises(ConfigError, match="fit no pd mode"):
        Router(parse_workers("a=colocated@http://h:1"), RouterConfig(mode="pd"))
    with pytest.raises(ConfigError, match="fit no auto mode"):
        Router(parse_workers("a=colocated@http://h:1,p=prefill@http://h:2"))
    with pytest.raises(ConfigError, match="fit no auto mode"):
        Router([])


def test_router_file_reads_tables_and_overrides(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "router.toml"
    path.write_text(
        'workers = "a=colocated@http://h:1"\nshed_lag_ms = 100\n[router]\nmode = "pd"\n'
        "[router.cost]\ndecode_step_s = 0.05\n[conductor]\nttft_slo_s = 2\n"
    )
    settings = load(RouterAppConfig, path, ["router.poll_interval_s=0.25", "conductor.rejection=early"])
    router, conductor = settings.router, settings.conductor
    assert (settings.workers, settings.shed_lag_ms, settings.backend) == ("a=colocated@http://h:1", 100.0, "tsukimi")
    assert (router.mode, router.cost.decode_step_s, router.poll_interval_s) == ("pd", 0.05, 0.25)
    assert (conductor.ttft_slo_s, conductor.rejection) == (2.0, "early")
    assert conductor.decode_estimate_s == ROUTER_CONDUCTOR.decode_estimate_s == 0  # the live router's defaults
    assert LinearCostModel.from_config(router.cost).decode_step_s(1, 0) == pytest.approx(0.05)
    with pytest.raises(ConfigError, match="unknown key"):
        load(RouterAppConfig, None, ["router.nope=1"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load(RouterAppConfig, None, ["router.read_timeout_s=0"])
    with pytest.raises(ConfigError, match="must be >= 0"):
        load(RouterAppConfig, None, ["router.cost.prefill_token_s=-1"])


def test_a_router_built_in_code_gets_the_live_routers_conductor() -> None:
    """The simulator's 10 s decode-stage prior once reached a `Router` built in code (1095f22)."""
    router = Router(parse_workers("p=prefill@http://h:1,d=decode@http://h:2"))
    assert router._conductor_config == ROUTER_CONDUCTOR


def test_router_command_flags_map_onto_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "router",
            "--workers",
            "a=colocated@http://h:1",
            "--mode",
            "colocated",
            "--shed-lag-ms",
            "0",
            "--master-http",
            "http://m:1",
            "--set",
            "router.policy=round_robin",
            "--set",
            "conductor.ttft_slo_s=5",
        ]
    )
    config = settings(args)
    assert (config.host, config.port, config.model, config.backend) == ("127.0.0.1", 8000, "tiny", "tsukimi")
    assert (config.workers, config.router.mode, config.shed_lag_ms, config.master_http) == (
        "a=colocated@http://h:1",
        "colocated",
        0.0,
        "http://m:1",
    )
    assert (config.router.policy, config.conductor.ttft_slo_s) == ("round_robin", 5.0)
    vllm = settings(parser.parse_args(["router", "--backend", "vllm", "--pool", "--vllm-block-size", "16"]))
    assert (vllm.backend, vllm.vllm.pool, vllm.vllm.block_size) == ("vllm", True, 16)


# -- colocated ------------------------------------------------------------------------------


def test_colocated_least_load_follows_polled_loads(workers: list[FakeWorker]) -> None:
    workers += [FakeWorker("a", load={"running": 3}), FakeWorker("b")]
    router = Router([w.spec for w in workers], FAST)

    async def body(router: Router) -> None:
        for i in range(3):
            events = await collect(router, request([10, 20, 30], 4, f"r{i}"))
            assert tokens(events) == [31, 32, 33, 34]
            assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])
            assert {e.worker for e in events} == {"b"}

    run_with(router, body)
    assert (len(workers[0].calls), len(workers[1].calls)) == (0, 3)
    [record] = router.decisions.get(["r1"])
    assert (record.mode, record.prefill, record.decode, record.predicted_ttft_s) == ("colocated", "b", "", None)
    assert (record.expected_cached_tokens, record.conductor_id, record.cached_tokens) == (None, None, 0)
    assert workers[1].calls[0] == {
        "request_id": "r0",
        "prompt_ids": [10, 20, 30],
        "max_tokens": 4,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "stop_token_ids": [],
        "ignore_eos": False,
        "weights_version": "",
    }


def test_colocated_least_load_counts_requests_in_flight(workers: list[FakeWorker]) -> None:
    workers += [FakeWorker("a"), FakeWorker("b")]
    workers[0].gated = True
    router = Router([w.spec for w in workers], FAST)

    async def body(router: Router) -> None:
        held = router.generate(request([1], 3, "held"))
        assert (await anext(held)).worker == "a"  # a tie goes to the first worker
        assert [w.in_flight for w in router.workers()] == [1, 0]
        assert {e.worker for e in await collect(router, request([1], 3, "next"))} == {"b"}
        workers[0].gate.set()
        assert tokens([e async for e in held]) == [3, 4]
        assert [w.in_flight for w in router.workers()] == [0, 0]
        assert {e.worker for e in await collect(router, request([1], 3, "third"))} == {"a"}

    run_with(router, body)


def test_colocated_round_robin(workers: list[FakeWorker]) -> None:
    workers += [FakeWorker("a", load={"running": 5}), FakeWorker("b")]
    router = Router([w.spec for w in workers], RouterConfig(policy="round_robin", startup_timeout_s=1.0))

    async def body(router: Router) -> list[str]:
        return [(await collect(router, request([1], 1, f"r{i}")))[0].worker for i in range(4)]

    assert run_with(router, body) == ["a", "b", "a", "b"]


# -- PD ---------------------------------------------------------------------------------------


def pd_router(workers: list[FakeWorker], conductor: ConductorConfig | None = None, **knobs: object) -> Router:
    workers += [FakeWorker("p0", "prefill", cached=4, **knobs), FakeWorker("d0", "decode")]
    return Router([w.spec for w in workers], FAST, conductor or NO_REJECTION)


NO_REJECTION = dataclasses.replace(ROUTER_CONDUCTOR, rejection="none")


def test_pd_flow_prefill_then_decode(workers: list[FakeWorker]) -> None:
    router = pd_router(workers)

    async def body(router: Router) -> list[TokenEvent]:
        events = [
            event
            async for event in router.generate(request(PROMPT, 5, "cmpl-pd-1", seed=7, stop_token_ids=(999,)), "pd-1")
        ]
        return events

    events = run_with(router, body)
    prefill, decode = workers
    assert tokens(events) == [110, 111, 112, 113, 114]
    assert [e.worker for e in events] == ["p0"] + ["d0"] * 4
    assert events[0].finish_reason is None and events[-1].finish_reason == "length"
    assert (events[0].cached_tokens, events[0].pool_tokens) == (4, 2)
    [p_call], [d_call] = prefill.calls, decode.calls
    # NOTE: the request as it is: the prefill worker makes one token by its role (the one place)
    assert (p_call["prompt_ids"], p_call["max_tokens"], p_call["seed"]) == (PROMPT, 5, 7)
    assert (d_call["prompt_ids"], d_call["max_tokens"]) == ([*PROMPT, 110], 4)
    assert d_call["stop_token_ids"] == [999] and d_call["request_id"] == p_call["request_id"] == "cmpl-pd-1"
    # The router records nothing itself: its index learns from the workers' KV events only (a
    # fake worker publishes none), so it expected no reuse at all.
    assert router.index.match(hash_blocks(PROMPT, BLOCK_TOKENS)) == {}
    [record] = router.decisions.get(["pd-1"])  # NOTE: the client's id, not the workers'
    assert (record.mode, record.accepted, record.prefill, record.decode) == ("pd", True, "p0", "d0")
    assert (record.expected_cached_tokens, record.expected_pool_tokens, record.expected_concurrent) == (0, 0, False)
    assert (record.cached_tokens, record.pool_tokens, record.prompt_tokens) == (4, 2, len(PROMPT))
    assert record.conductor_id == 0 and record.predicted_ttft_s is not None and not record.queued
    assert router.block_tokens == BLOCK_TOKENS
    conductor = router.conductor
    assert conductor is not None and conductor.counters["accepted"] == 1
    assert conductor.prefill_queue_s("p0", router.clock.now()) == 0.0


def test_pd_finishes_at_prefill(workers: list[FakeWorker]) -> None:
    router = pd_router(workers)

    async def body(router: Router) -> tuple[list[TokenEvent], list[TokenEvent]]:
        one = await collect(router, request(PROMPT, 1, "one"))
        stopped = await collect(router, request(PROMPT, 8, "stop", stop_token_ids=(110,)))
        return one, stopped

    one, stopped = run_with(router, body)
    assert [(tokens(one), one[-1].finish_reason)] == [([110], "length")]
    assert [(tokens(stopped), stopped[-1].finish_reason)] == [([], "stop")]
    assert len(workers[0].calls) == 2 and workers[1].calls == []


def test_pd_rejection_is_typed_with_reason(workers: list[FakeWorker]) -> None:
    router = pd_router(workers, dataclasses.replace(ROUTER_CONDUCTOR, rejection="baseline", ttft_slo_s=1e-6))

    async def body(router: Router) -> None:
        with pytest.raises(Rejected) as info:
            await collect(router, request(PROMPT, 4))
        assert info.value.reason == "ttft_slo"

    run_with(router, body)
    assert workers[0].calls == [] and workers[1].calls == []
    [record] = router.decisions.get(["r"])
    assert (record.accepted, record.reason, record.prefill, record.cached_tokens) == (False, "ttft_slo", "", None)
    assert "TTFT" in record.message and record.predicted_ttft_s is not None and record.predicted_ttft_s > 1e-6


def test_pd_rejection_at_decode_comes_after_the_prefill(workers: list[FakeWorker]) -> None:
    router = pd_router(workers, dataclasses.replace(ROUTER_CONDUCTOR, rejection="baseline", tbt_slo_s=1e-6))

    async def body(router: Router) -> None:
        with pytest.raises(Rejected) as info:
            await collect(router, request(PROMPT, 4))
        assert info.value.reason == "rejected_at_decode"

    run_with(router, body)
    assert len(workers[0].calls) == 1 and workers[1].calls == []  # the prefill was wasted (baseline mode)
    [record] = router.decisions.get(["r"])
    assert (record.accepted, record.reason, record.prefill, record.decode) == (False, "rejected_at_decode", "p0", "")


def test_a_burst_whose_decode_batch_breaks_the_tbt_slo_waits_and_is_served_whole(workers: list[FakeWorker]) -> None:
    # NOTE: the decode worker's profile: a step of 10 ms + 1 ms per request, so a 12.5 ms TBT SLO
    # takes two at a time; each token takes 20 ms, so the burst's eight overlap in decode
    prefill = {"prefill_coef": [0.001, 1e-5, 0.0], "decode_coef": [1.0, 1.0, 1.0], "kv_bytes_per_token": 64}
    decode = {"prefill_coef": [1.0, 1.0, 1.0], "decode_coef": [0.01, 0.001, 0.0], "kv_bytes_per_token": 64}
    workers += [FakeWorker("p0", "prefill", cost=prefill), FakeWorker("d0", "decode", cost=decode, delay_s=0.02)]

    def burst(kv_wait: bool) -> tuple[list[list[int] | str], Router]:
        config = dataclasses.replace(ROUTER_CONDUCTOR, tbt_slo_s=0.0125, kv_wait=kv_wait)
        router = Router([w.spec for w in workers], FAST, config)

        async def one(i: int) -> list[int] | str:
            try:
                return tokens(await collect(router, request(PROMPT, 4, f"b{i}"), f"burst-{i}"))
            except Rejected as exc:
                return exc.reason

        async def body(router: Router) -> list[list[int] | str]:
            return list(await asyncio.gather(*(one(i) for i in range(8))))

        return run_with(router, body), router

    served, router = burst(kv_wait=True)
    assert served == [[110, 111, 112, 113]] * 8
    records = router.decisions.get([f"burst-{i}" for i in range(8)])
    waited = [r for r in records if r.queued or r.decode_wait_s is not None]
    assert waited and all(r.accepted for r in records)
    assert router.conductor is not None and router.conductor.counters["rejected_at_decode"] == 0
    rejecting, _ = burst(kv_wait=False)  # NOTE: the paper's policies: the same burst is partly turned away
    assert {r for r in rejecting if isinstance(r, str)} and [110, 111, 112, 113] in rejecting


def test_the_start_up_probe_seeds_the_per_job_prefill_term(workers: list[FakeWorker]) -> None:
    cost = {"prefill_coef": [1e-5, 1e-7, 0.0], "decode_coef": [1e-3, 0.0, 0.0], "kv_bytes_per_token": 64}
    workers += [FakeWorker("p0", "prefill", cost=cost), FakeWorker("d0", "decode", cost=cost)]
    router = Router([w.spec for w in workers], dataclasses.replace(FAST, overhead_probe=True), ROUTER_CONDUCTOR)

    async def body(router: Router) -> float:
        await router.start()
        assert router.conductor is not None and router.conductor.service is not None
        return router.conductor.service.prior_s

    prior = run_with(router, body)
    [probe] = workers[0].calls
    assert probe["request_id"].startswith("tsukimi-overhead-probe") and probe["max_tokens"] == 1
    assert len(probe["prompt_ids"]) == BLOCK_TOKENS and workers[1].calls == []
    # NOTE: the fake's answer takes an HTTP round trip the cost model (11.6 us of prefill) leaves out
    assert 0.0 < prior < 5.0 and router.decisions.recent() == []
    assert router.conductor is not None and router.conductor.prefill_queue_s("p0", router.clock.now()) == 0.0


def test_a_prefill_worker_gets_at_most_two_prompts_at_a_time_in_booked_order(workers: list[FakeWorker]) -> None:
    workers += [FakeWorker("p0", "prefill", delay_s=0.03), FakeWorker("d0", "decode")]
    router = Router([w.spec for w in workers], FAST, NO_REJECTION)

    async def body(router: Router) -> int:
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, router._workers["p0"].in_flight)
                await asyncio.sleep(0.002)

        await router.start()
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(collect(router, request(PROMPT, 2, f"o{i}"), f"order-{i}") for i in range(6)))
        watcher.cancel()
        return peak

    assert run_with(router, body) == 2
    # NOTE: each prompt reached the worker in the order the Conductor booked it
    records = sorted(router.decisions.get([f"order-{i}" for i in range(6)]), key=lambda r: r.conductor_id or 0)
    sent = [call["request_id"] for call in workers[0].calls]
    assert sent == [f"o{r.request_id.removeprefix('order-')}" for r in records]


def test_pd_closing_early_aborts_decode_and_frees_the_conductor(workers: list[FakeWorker]) -> None:
    router = pd_router(workers)
    workers[1].gated = True

    async def body(router: Router) -> None:
        events = router.generate(request(PROMPT, 50, "early"))
        assert (await anext(events)).worker == "p0"
        assert (await anext(events)).worker == "d0"
        await events.aclose()
        assert [w.in_flight for w in router.workers()] == [0, 0]
        # the next request still runs to the end
        assert tokens(await collect(router, request(PROMPT, 2, "after"))) == [110, 111]

    run_with(router, body)
    assert workers[1].disconnected.wait(2.0)


def test_pd_round_robin_is_a_baseline_without_the_conductor(workers: list[FakeWorker]) -> None:
    workers += [FakeWorker("p0", "prefill"), FakeWorker("p1", "prefill"), FakeWorker("d0", "decode")]
    router = Router([w.spec for w in workers], dataclasses.replace(FAST, policy="round_robin"))

    async def body(router: Router) -> list[str]:
        return [(await collect(router, request(PROMPT, 2, f"rr{i}")))[0].worker for i in range(3)]

    assert run_with(router, body) == ["p0", "p1", "p0"]
    assert router.conductor is None and len(workers[2].calls) == 3
    [record] = router.decisions.get(["rr1"])
    assert (record.prefill, record.decode, record.conductor_id, record.predicted_ttft_s) == ("p1", "d0", None, None)
    assert record.expected_cached_tokens == 0  # NOTE: the index is read in PD mode all the same


# -- failures -------------------------------------------------------------------------------


def test_unreachable_worker_is_503_promptly_and_skipped(workers: list[FakeWorker]) -> None:
    workers.append(FakeWorker("live"))
    started = time.monotonic()
    quick = dataclasses.replace(FAST, startup_timeout_s=0.3)  # NOTE: the dead one is waited for until then
    alone = Router([WorkerSpec("dead", "colocated", dead_url())], quick)

    async def fails(router: Router) -> None:
        with pytest.raises(WorkerUnavailable, match="no colocated worker"):
            await collect(router, request([1], 2))

    run_with(alone, fails)
    assert time.monotonic() - started < 3.0
    both = Router([WorkerSpec("dead", "colocated", dead_url()), workers[0].spec], quick)

    async def succeeds(router: Router) -> None:
        assert tokens(await collect(router, request([1], 2))) == [2, 3]
        assert [w.healthy for w in router.workers()] == [False, True]

    run_with(both, succeeds)


def test_worker_that_dies_after_start_is_retried_elsewhere(workers: list[FakeWorker]) -> None:
    workers += [FakeWorker("a"), FakeWorker("b", load={"running": 1})]
    router = Router([w.spec for w in workers], RouterConfig(poll_interval_s=60, startup_timeout_s=1.0))

    async def body(router: Router) -> None:
        await router.start()
        workers[0].close()  # refused connections from now on; the poller has not noticed yet
        events = await collect(router, request([1], 2))
        assert {e.worker for e in events} == {"b"}

    run_with(router, body)


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (502, WorkerError),
        (400, InvalidArgument),
        (503, WorkerUnavailable),
        (409, DuplicateRequest),
        (500, WorkerError),  # the worker sent its root TsukimiError: the worker failed
    ],
)
def test_a_workers_error_arrives_as_its_own_class(
    workers: list[FakeWorker], status: int, error: type[Exception]
) -> None:
    """Errors cross as (code, message): the class raised is the worker's, not one guessed from
    the status (a 409 used to arrive as a generic WorkerError, and reach API clients as 502)."""
    workers.append(FakeWorker("a", status=status))
    router = Router([workers[0].spec], FAST)

    async def body(router: Router) -> None:
        with pytest.raises(error, match=f"scripted {status}$") as info:
            await collect(router, request([1], 2))
        assert type(info.value) is error

    run_with(router, body)


@pytest.mark.parametrize(("status", "error"), [(502, WorkerError), (500, WorkerError), (503, WorkerUnavailable)])
def test_a_non_protocol_answer_is_judged_by_its_status(
    workers: list[FakeWorker], status: int, error: type[Exception]
) -> None:
    workers.append(FakeWorker("a", status=status, raw=True))  # a proxy's or a crashed server's page
    router = Router([workers[0].spec], FAST)

    async def body(router: Router) -> None:
        with pytest.raises(error, match=f"worker a answered HTTP {status}: scripted {status}"):
            await collect(router, request([1], 2))

    run_with(router, body)


def test_stalled_worker_times_out(workers: list[FakeWorker]) -> None:
    workers.append(FakeWorker("slow", hang=True))
    config = RouterConfig(read_timeout_s=0.3, startup_timeout_s=1.0)
    router = Router([workers[0].spec], config)
    started = time.monotonic()

    async def body(router: Router) -> None:
        with pytest.raises(WorkerError, match=r"did not answer within 0\.3 s"):
            await collect(router, request([1], 2))

    run_with(router, body)
    assert time.monotonic() - started < 3.0


def test_aborted_stream_is_a_worker_error(workers: list[FakeWorker]) -> None:
    workers.append(FakeWorker("a", abort=True))
    router = Router([workers[0].spec], FAST)

    async def body(router: Router) -> None:
        with pytest.raises(WorkerError, match="worker a: the engine failed: scripted"):
            await collect(router, request([1], 3))

    run_with(router, body)


def test_pd_prefill_failure_releases_the_booking(workers: list[FakeWorker]) -> None:
    router = pd_router(workers, status=500)

    async def body(router: Router) -> None:
        with pytest.raises(WorkerError):
            await collect(router, request(PROMPT, 4))
        conductor = router.conductor
        assert conductor is not None and conductor.prefill_queue_s("p0", router.clock.now()) == 0.0

    run_with(router, body)
    assert router.index.locations() == []  # nothing was cached


def test_role_mismatch_is_a_config_error(workers: list[FakeWorker]) -> None:
    workers.append(FakeWorker("a", reported_role="prefill"))
    router = Router([workers[0].spec], FAST)

    async def body(router: Router) -> None:
        with pytest.raises(ConfigError, match="declared colocated but reports prefill"):
            await router.start()

    run_with(router, body)


def test_pd_places_again_when_a_prefill_worker_is_down(workers: list[FakeWorker]) -> None:
    workers += [FakeWorker("p0", "prefill"), FakeWorker("p1", "prefill"), FakeWorker("d0", "decode")]
    router = Router([w.spec for w in workers], FAST, dataclasses.replace(ROUTER_CONDUCTOR, rejection="none"))

    async def body(router: Router) -> None:
        await router.start()
        workers[0].handle.stop(timeout_s=2.0)  # p0, the Conductor's first choice on a tie, dies
        events = await collect(router, request(PROMPT, 3, "pd-2"))
        assert tokens(events) == [110, 111, 112] and events[0].worker == "p1"
        assert [w.healthy for w in router.workers() if w.role == "prefill"] == [False, True]
        workers[1].handle.stop(timeout_s=2.0)
        with pytest.raises(WorkerUnavailable, match="marked down"):
            await collect(router, request(PROMPT, 3, "pd-3"))

    run_with(router, body)


def test_regression_a_client_id_already_running_is_409_and_keeps_its_record(workers: list[FakeWorker]) -> None:
    """Two requests with one X-Request-Id on two workers: the engine's own duplicate check never
    sees both, and the second used to replace the first one's decision record (review of
    issue 22). The second is now DuplicateRequest at the router; the first's record stays."""
    workers += [FakeWorker("a"), FakeWorker("b")]
    workers[0].gated = True
    router = Router([w.spec for w in workers], FAST)

    async def body(router: Router) -> None:
        held = router.generate(request([1], 3, "cmpl-x"), "x")
        assert (await anext(held)).worker == "a"
        with pytest.raises(DuplicateRequest, match=r"request 'x' \(cmpl-x2\) is already running"):
            await collect(router, request([1], 3, "cmpl-x2"), "x")
        [record] = router.decisions.get(["x"])
        assert (record.prefill, record.accepted) == ("a", True)
        workers[0].gate.set()
        assert tokens([e async for e in held]) == [3, 4]
        assert {e.worker for e in await collect(router, request([1], 3, "cmpl-x3"), "x")} == {"a"}  # done: free again

    run_with(router, body)


def test_least_load_over_pd_workers_is_a_config_error_not_a_silent_baseline(workers: list[FakeWorker]) -> None:
    """At 95fb9ff pd ignored `router.policy` (least_load, the old default, applied to colocated
    workers only); since round_robin became a pd baseline, least_load there would have dropped
    the Conductor without a word: it is refused, naming the choices."""
    specs = [WorkerSpec("p", "prefill", dead_url()), WorkerSpec("d", "decode", dead_url())]
    with pytest.raises(ConfigError, match="least_load places colocated workers; in pd mode choose auto or conductor"):
        Router(specs, dataclasses.replace(FAST, policy="least_load"))
    assert Router(specs, FAST).policy == "conductor"
