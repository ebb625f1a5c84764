"""`tsukimi bench kv-burst`: a burst of concurrent long prompts against a live PD cluster of the
tiny model: queue, then reject (issue 17), measured end to end.

    tsukimi bench kv-burst [--requests 64] [--prompt-tokens 1500] [--max-tokens 16]
        [--prompts distinct|identical|mixed] [--no-stream] [--ttft-slo 30] [--tbt-slo S] [--decode-num-blocks 0]
        [--kv-cache-memory 512MiB] [--no-kv-wait] [--warm-up] [--prefill-token-s S] [--json | --markdown]

The cluster is `tsukimi up`'s own plan (tsukimi/bench/up_cluster.py): a store master, the
metadata server, one prefill and one decode `tsukimi worker` (each KV cache sized by
`--kv-cache-memory` unless `--decode-num-blocks` sets the decode worker's) and `tsukimi router`,
whose Conductor gets this burst's settings (`--ttft-slo`, `--tbt-slo`, `--no-kv-wait`, `--prefill-token-s`)
as `--set`s. On the cold cluster (as right after `tsukimi up`; `--warm-up` sends one short
request first, after which the Conductor knows a decode stage and an output length) it sends
`--requests` greedy /v1/completions at once (streaming unless `--no-stream`; `--prompts`: distinct
prompts, one identical prompt, or mixed lengths), each with an `X-Request-Id` of its own,
then each prompt again one at a time, and reports: how many were served, queued and rejected
(with the reason and message), the measured TTFT of each against the TTFT the Conductor
predicted at its arrival (the router's decision records of those ids: tsukimi/bench/decisions.py),
how many served ones met the SLO, and whether the burst's tokens equal the one-at-a-time ones.

A `BurstCluster` keeps the workers up between bursts (a test runs several): each burst gets a
router of its own, started with its settings and stopped after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from tsukimi.bench.client import CompletionRequest, CompletionResult, Kind, complete
from tsukimi.bench.decisions import fetch_decisions
from tsukimi.bench.report import BenchReport, FigureViews, Verdict, begin, finish, generic_markdown
from tsukimi.bench.up_cluster import planned
from tsukimi.errors import ConfigError
from tsukimi.serving.cluster.launcher import LaunchedCluster, with_args
from tsukimi.serving.cluster.process_spec import ProcessSpec
from tsukimi.serving.router.decision_log import DecisionRecord

WARM_UP = tuple(range(100, 164))
_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class BurstConfig:
    """The burst and the cluster it runs against (see the module)."""

    requests: int = 64
    prompt_tokens: int = 1500
    max_tokens: int = 16
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.0  # 0: the router's own
    kv_cache_memory: str = "512MiB"
    decode_num_blocks: int = 0  # 0: sized from kv_cache_memory
    seed: int = 0
    prompts: Literal["distinct", "identical", "mixed"] = "distinct"  # mixed: lengths from 1/8 to all of prompt_tokens
    stream: bool = True
    kv_wait: bool = True  # False: the Conductor rejects what lacks decode KV at once (before issue 17)
    warm_up: bool = False  # one short request first: the Conductor then knows a decode stage and output length
    prefill_token_s: float = 0.0  # the router's cost model per prompt token (0: the workers' profiles)

    def router_settings(self) -> tuple[str, ...]:
        """The `tsukimi router` arguments this burst's Conductor needs (pure)."""
        sets = [f"conductor.ttft_slo_s={self.ttft_slo_s}", f"conductor.kv_wait={str(self.kv_wait).lower()}"]
        if self.tbt_slo_s:
            sets.append(f"conductor.tbt_slo_s={self.tbt_slo_s}")
        if self.prefill_token_s:  # NOTE: the config's cost model instead of the workers' start-up profiles
            sets += [f"router.cost.prefill_token_s={self.prefill_token_s}", 'router.cost_model="config"']
        return tuple(f"--set={s}" for s in sets)


@dataclass(frozen=True, slots=True)
class BurstOutcome:
    """One request of the burst: how it ended and what the Conductor predicted at its arrival
    (None: the router kept no record of it). `ttft_s` of a non-streaming request is its whole
    latency (the first token's upper bound)."""

    index: int
    kind: Kind
    status: int
    ttft_s: float
    text: str
    reason: str
    message: str
    request_id: str
    predicted_ttft_s: float | None = None
    queued: bool = False
    decode_wait_s: float | None = None  # its wait, prefilled, for a place in the decode batch

    @classmethod
    def of(cls, index: int, result: CompletionResult, record: DecisionRecord | None) -> BurstOutcome:
        """The outcome of `result`, with `record`'s prediction (pure)."""
        return cls(
            index,
            result.kind,
            result.status,
            result.ttft_s if result.stream else result.latency_s,  # NOTE: not streamed: its bound, the whole answer
            result.text,
            result.reason,
            result.message,
            result.request_id,
            record.predicted_ttft_s if record is not None else None,
            record.queued if record is not None else False,
            record.decode_wait_s if record is not None else None,
        )


@dataclass(slots=True)
class BurstResult:
    config: BurstConfig
    decode_capacity_tokens: int = 0
    wall_s: float = 0.0
    outcomes: list[BurstOutcome] = field(default_factory=list)
    same_tokens_as_sequential: bool = False

    def summary(self) -> dict[str, object]:
        """The figures: counts, SLO attainment of the served ones, prediction vs outcome."""
        served = [o for o in self.outcomes if o.kind == "served"]
        rejected = [o for o in self.outcomes if o.kind == "rejected"]
        slo = self.config.ttft_slo_s
        predicted = [(o, o.predicted_ttft_s) for o in served if o.predicted_ttft_s is not None]
        errors = [o.ttft_s - p for o, p in predicted]
        records = sum(o.predicted_ttft_s is not None for o in self.outcomes)

        def known(count: int) -> int | None:  # NOTE: None: the router kept no record to tell
            return count if records else None

        return {
            "requests": len(self.outcomes),
            "served": len(served),
            "rejected": len(rejected),
            "queued": known(sum(o.queued for o in self.outcomes)),
            "waited_at_decode": known(sum(o.decode_wait_s is not None for o in self.outcomes)),
            "other_errors": len(self.outcomes) - len(served) - len(rejected),
            "decision_records": records,
            "decode_capacity_tokens": self.decode_capacity_tokens,
            "rejected_by": {r: sum(o.reason == r for o in rejected) for r in sorted({o.reason for o in rejected})},
            "rejected_predicted_to_miss": known(sum((o.predicted_ttft_s or 0.0) > slo for o in rejected)),
            "served_met_slo": sum(o.ttft_s <= slo for o in served),
            "served_predicted_to_meet": known(sum(p <= slo for _, p in predicted)),
            "ttft_max_s": round(max((o.ttft_s for o in served), default=0.0), 3),
            "prediction_error_s": {
                "mean": round(sum(errors) / len(errors), 3) if errors else 0.0,
                "max_late": round(max(errors, default=0.0), 3),
            },
            "same_tokens_as_sequential": self.same_tokens_as_sequential,
            "wall_s": round(self.wall_s, 2),
        }


class BurstCluster:
    """The PD workers of a burst (see the module), launched on entering; `router(cfg)` starts
    a router with a burst's settings. Not thread-safe."""

    def __init__(self, cfg: BurstConfig, workdir: Path) -> None:
        settings = [
            'model="tiny"',
            'mode="pd"',
            f'workers.kv_cache_memory="{cfg.kv_cache_memory}"',
            "workers.num_blocks=0",
            "router.port=0",
        ]
        groups, launch = planned(settings, workdir)
        # NOTE: the decode worker's own KV size (the last --num-blocks wins); the router starts per burst
        workers = with_args(groups[:-1], "decode-0", "--num-blocks", str(cfg.decode_num_blocks))
        self.cluster = LaunchedCluster(workers, launch)
        self._router: ProcessSpec = groups[-1][0]

    @property
    def decode_url(self) -> str:
        return self.cluster.process("decode-0").url

    def decode_capacity_tokens(self) -> int:
        """The decode worker's KV cache in tokens (its /load total_blocks x /health block_tokens),
        what the router's Conductor takes as its capacity."""
        load = httpx.get(self.decode_url + "/load", timeout=10).json()
        health = httpx.get(self.decode_url + "/health", timeout=10).json()
        return int(load["total_blocks"]) * int(health["block_tokens"])

    @contextlib.contextmanager
    def router(self, cfg: BurstConfig) -> Iterator[str]:
        """A `tsukimi router` over the workers with `cfg`'s Conductor settings; its API URL.

        Raises:
            PeerError: it did not start.
        """
        spec = self._router
        self.cluster.start_group([ProcessSpec(spec.name, spec.role, (*spec.args, *cfg.router_settings()), spec.url)])
        try:
            yield spec.url
        finally:
            self.cluster.drop_group()

    def __enter__(self) -> BurstCluster:
        self.cluster.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop()


@contextlib.contextmanager
def burst_cluster(cfg: BurstConfig) -> Iterator[BurstCluster]:
    """A `BurstCluster` for `cfg`'s workers, logging under a temporary directory."""
    with (
        tempfile.TemporaryDirectory(prefix="tsukimi-bench-kv-burst-") as workdir,
        BurstCluster(cfg, Path(workdir)) as c,
    ):
        yield c


def run_burst(cfg: BurstConfig, cluster: BurstCluster | None = None) -> BurstResult:
    """Runs the burst (see the module) on `cluster` (None: starts one for `cfg` and stops it
    after; a given one must have `cfg`'s worker settings); blocks until done.

    Raises:
        PeerError: the cluster or its router did not start. ConfigError: bad settings.
    """
    if cluster is None:
        with burst_cluster(cfg) as started:
            return run_burst(cfg, started)
    if cfg.requests < 1 or cfg.prompt_tokens < 1:
        raise ConfigError("a burst needs >= 1 request of >= 1 token")
    rng_prompts = _prompts(cfg)
    token = uuid.uuid4().hex[:8]
    result = BurstResult(cfg, decode_capacity_tokens=cluster.decode_capacity_tokens())
    with cluster.router(cfg) as api:
        if cfg.warm_up:
            asyncio.run(complete(api, "tiny", _request(WARM_UP, cfg, f"burst-{token}-warm"), _TIMEOUT_S))
        requests = [_request(p, cfg, f"burst-{token}-{i}") for i, p in enumerate(rng_prompts)]
        start = time.perf_counter()
        results = asyncio.run(_all_at_once(api, requests))
        result.wall_s = time.perf_counter() - start
        records = fetch_decisions(api, [r.request_id or q.request_id for q, r in zip(requests, results, strict=True)])
        result.outcomes = [
            BurstOutcome.of(i, r, records.get(r.request_id or requests[i].request_id)) for i, r in enumerate(results)
        ]
        sequential = [
            asyncio.run(complete(api, "tiny", _request(p, cfg, f"burst-{token}-seq-{i}"), _TIMEOUT_S))
            for i, p in enumerate(rng_prompts)
        ]
    served = [(o.text, s.text) for o, s in zip(result.outcomes, sequential, strict=True) if o.kind == "served"]
    result.same_tokens_as_sequential = bool(served) and all(a == b for a, b in served)
    return result


def _prompts(cfg: BurstConfig) -> list[tuple[int, ...]]:
    """The burst's prompts: `distinct` ones of `prompt_tokens`, one `identical` prompt (one
    system prompt, many users), or `mixed` lengths (pure: seeded)."""
    import random

    rng = random.Random(cfg.seed)

    def prompt(tokens: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1000, 30000) for _ in range(tokens))

    if cfg.prompts == "identical":
        return [prompt(cfg.prompt_tokens)] * cfg.requests
    if cfg.prompts == "mixed":
        return [prompt(rng.randint(max(1, cfg.prompt_tokens // 8), cfg.prompt_tokens)) for _ in range(cfg.requests)]
    return [prompt(cfg.prompt_tokens) for _ in range(cfg.requests)]


def _request(prompt: tuple[int, ...], cfg: BurstConfig, request_id: str) -> CompletionRequest:
    return CompletionRequest(prompt, cfg.max_tokens, stream=cfg.stream, request_id=request_id, ignore_eos=True)


async def _all_at_once(api: str, requests: list[CompletionRequest]) -> list[CompletionResult]:
    return list(await asyncio.gather(*(complete(api, "tiny", r, _TIMEOUT_S) for r in requests)))


def figures_of(result: BurstResult) -> dict[str, object]:
    """The report's figures: the summary, then every request's outcome (pure)."""
    return {**result.summary(), "outcomes": [asdict(o) for o in result.outcomes]}


def verdicts(figures: Mapping[str, object], ttft_slo_s: float) -> list[Verdict]:
    """What issue 17 asks of a burst, judged on `figures_of`'s figures (pure)."""
    outcomes = figures["outcomes"]
    assert isinstance(outcomes, list)
    by_slo = [o for o in outcomes if o["kind"] == "rejected" and o["reason"] == "ttft_slo"]
    unpredicted = [o for o in by_slo if o["predicted_ttft_s"] is None or o["predicted_ttft_s"] <= ttft_slo_s]
    served, met = int(str(figures["served"])), int(str(figures["served_met_slo"]))
    records = int(str(figures["decision_records"]))
    return [
        Verdict(
            "ttft_rejections_predicted",
            "every request rejected for the TTFT SLO was predicted at arrival to miss it",
            None if by_slo and not records else not unpredicted,
            f"{len(by_slo) - len(unpredicted)} of {len(by_slo)} (decision records of {records} requests)",
        ),
        Verdict(
            "served_within_slo",
            f"every served request's TTFT within {ttft_slo_s:g} s",
            met == served,
            f"{met} of {served}",
        ),
        Verdict(
            "same_tokens",
            "the burst's greedy tokens equal one at a time",
            bool(figures["same_tokens_as_sequential"]),
        ),
        Verdict("no_other_errors", "every request served or rejected with a reason", figures["other_errors"] == 0),
    ]


def run_report(cfg: BurstConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench kv-burst`: run (see `run_burst`) and report."""
    start = begin("bench kv-burst", cfg)
    progress(f"starting a PD cluster of the tiny model; then {cfg.requests} prompts of {cfg.prompt_tokens} tokens")
    figures = figures_of(run_burst(cfg))
    return finish(start, figures, verdicts(figures, cfg.ttft_slo_s))


def markdown(figures: Mapping[str, object]) -> str:
    """The summary as a table (the outcomes are in the JSON). Pure."""
    return generic_markdown({k: v for k, v in figures.items() if k != "outcomes"})


VIEWS = FigureViews(markdown)
