"""A burst of concurrent long prompts against a live PD cluster of the tiny model: queue, then
reject (issue 17) measured end to end.

    python -m tsukimi.bench.kv_burst [--requests 64] [--prompt-tokens 1500] [--max-tokens 16]
        [--ttft-slo 30] [--decode-num-blocks 0] [--kv-cache-memory 512MiB] [--no-kv-wait] [--warm-up]
        [--prefill-token-s S] [--json]

Starts a store master, one prefill and one decode `tsukimi worker` process (the tiny model,
each KV cache sized by `--kv-cache-memory` unless `--decode-num-blocks` sets the decode
worker's) and the router with the Conductor in this process (its decisions are recorded
through `Conductor.on_decision`), serving the OpenAI API over HTTP. On the cold cluster (as right
after `tsukimi up`; `--warm-up` sends one short request first, after which the Conductor knows a
decode stage and an output length) it sends `--requests` streaming greedy /v1/completions at
once, then each prompt again one at a time, and reports: how many were served, queued and
rejected (HTTP 429, with the reason and message), the measured TTFT of each against the TTFT
the Conductor predicted, how many accepted ones met the SLO, and whether the burst's tokens
equal the one-at-a-time ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import httpx

from tsukimi import httpd
from tsukimi.config import ROUTER_CONDUCTOR, LinearCostConfig, RouterConfig
from tsukimi.netio import free_port
from tsukimi.scheduler.block_hash import hash_blocks
from tsukimi.scheduler.conductor import Decision, ScheduleRequest
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.processes import stop_processes, wait_until

WARM_UP = list(range(100, 164))
BLOCK_TOKENS = 16  # the workers' (the router hashes prompts with it)
DecisionRecord = tuple[Decision, ScheduleRequest]


@dataclass(frozen=True, slots=True)
class BurstConfig:
    """The burst and the cluster it runs against (see the module)."""

    requests: int = 64
    prompt_tokens: int = 1500
    max_tokens: int = 16
    ttft_slo_s: float = 30.0
    kv_cache_memory: str = "512MiB"
    decode_num_blocks: int = 0  # 0: sized from kv_cache_memory
    seed: int = 0
    kv_wait: bool = True  # False: the Conductor rejects what lacks decode KV at once (before issue 17)
    warm_up: bool = False  # one short request first: the Conductor then knows a decode stage and output length
    prefill_token_s: float = 0.0  # the router's cost model per prompt token (0: the workers' profiles)


@dataclass(slots=True)
class Outcome:
    """One request of the burst: its HTTP status, measured TTFT and text; what was predicted."""

    index: int
    status: int = 0
    ttft_s: float = 0.0
    text: str = ""
    reason: str = ""
    message: str = ""
    predicted_ttft_s: float = 0.0
    queued: bool = False


@dataclass(slots=True)
class BurstResult:
    config: BurstConfig
    decode_capacity_tokens: int = 0
    wall_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    same_tokens_as_sequential: bool = False

    def summary(self) -> dict[str, object]:
        """The figures: counts, SLO attainment of the accepted ones, prediction vs outcome."""
        served = [o for o in self.outcomes if o.status == 200]
        rejected = [o for o in self.outcomes if o.status == 429]
        slo = self.config.ttft_slo_s
        errors = [o.ttft_s - o.predicted_ttft_s for o in served]
        return {
            "requests": len(self.outcomes),
            "served": len(served),
            "rejected": len(rejected),
            "queued": sum(o.queued for o in self.outcomes),
            "other_errors": len(self.outcomes) - len(served) - len(rejected),
            "decode_capacity_tokens": self.decode_capacity_tokens,
            "rejected_predicted_to_miss": sum(o.predicted_ttft_s > slo for o in rejected),
            "served_met_slo": sum(o.ttft_s <= slo for o in served),
            "served_predicted_to_meet": sum(o.predicted_ttft_s <= slo for o in served),
            "ttft_max_s": round(max((o.ttft_s for o in served), default=0.0), 3),
            "prediction_error_s": {
                "mean": round(sum(errors) / len(errors), 3) if errors else 0.0,
                "max_late": round(max(errors, default=0.0), 3),
            },
            "same_tokens_as_sequential": self.same_tokens_as_sequential,
            "wall_s": round(self.wall_s, 2),
        }


@contextlib.contextmanager
def pd_workers(cfg: BurstConfig) -> Iterator[dict[str, str]]:
    """A store master and a tiny prefill + decode worker process; their URLs by role."""
    store = TsukimiCluster(16 << 20, num_holders=0)
    procs: list[subprocess.Popen[bytes]] = []
    urls: dict[str, str] = {}
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            blocks = cfg.decode_num_blocks if role == "decode" else 0
            cmd = [
                sys.executable,
                "-m",
                "tsukimi.cli",
                "worker",
                "--name",
                role,
                "--role",
                role,
                "--model",
                "tiny",
                "--port",
                str(port),
                "--master",
                store.master_addr,
                "--kv-cache-memory",
                cfg.kv_cache_memory,
                "--num-blocks",
                str(blocks),
            ]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=tempfile.TemporaryFile()))  # noqa: SIM115
            urls[role] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_until(functools.partial(_healthy, url), 120)
        yield urls
    finally:
        stop_processes(procs)
        store.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def run_burst(cfg: BurstConfig, urls: dict[str, str] | None = None) -> BurstResult:
    """Runs the burst (see the module) against the workers at `urls` (by role; None: starts
    them, with `cfg`'s KV settings, and stops them after); blocks until done."""
    if urls is None:
        with pd_workers(cfg) as started:
            return run_burst(cfg, started)
    from tsukimi.engine.tokenizer import load_tokenizer
    from tsukimi.serving.openai.app import create_app
    from tsukimi.serving.router.router import Router
    from tsukimi.serving.router.workers import WorkerSpec

    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(cfg.prompt_tokens)] for _ in range(cfg.requests)]
    result = BurstResult(cfg)
    specs = [WorkerSpec(role, role, url) for role, url in urls.items()]  # type: ignore[arg-type]
    # NOTE: the workers' start-up profiles by default; --prefill-token-s: the config's cost model
    costs = RouterConfig(mode="pd", cost_model="config", cost=LinearCostConfig(prefill_token_s=cfg.prefill_token_s))
    conductor = dataclasses.replace(ROUTER_CONDUCTOR, ttft_slo_s=cfg.ttft_slo_s, kv_wait=cfg.kv_wait)
    router = Router(specs, costs if cfg.prefill_token_s else RouterConfig(mode="pd"), conductor)
    handle: httpd.AppHandle = httpd.start_in_thread(create_app(router, load_tokenizer("tiny"), "tiny"))
    try:
        api = handle.base_url
        # NOTE: a completion without a prompt (400) starts the router and schedules nothing
        assert httpx.post(api + "/v1/completions", json={"model": "tiny"}, timeout=60).status_code == 400
        if cfg.warm_up:
            asyncio.run(_complete(api, 0, WARM_UP, cfg.max_tokens, Outcome(-1)))
        decisions: list[DecisionRecord] = []
        assert router.conductor is not None
        router.conductor.on_decision = lambda decision, request: decisions.append((decision, request))
        result.decode_capacity_tokens = sum(router.conductor.decode_capacity_tokens().values())
        start = time.perf_counter()
        result.outcomes = asyncio.run(_burst(api, prompts, cfg.max_tokens))
        result.wall_s = time.perf_counter() - start
        _attach_predictions(result.outcomes, prompts, decisions)
        sequential = [asyncio.run(_complete(api, i, p, cfg.max_tokens, Outcome(i))) for i, p in enumerate(prompts)]
        served = [(o.text, s.text) for o, s in zip(result.outcomes, sequential, strict=True) if o.status == 200]
        result.same_tokens_as_sequential = bool(served) and all(a == b for a, b in served)
    finally:
        handle.stop()
    return result


def _attach_predictions(outcomes: list[Outcome], prompts: list[list[int]], decisions: list[DecisionRecord]) -> None:
    """Each request's decision at arrival (not its release), found by its prompt's block hashes."""
    first: dict[tuple[int, ...], Decision] = {}
    for decision, request in decisions:
        first.setdefault(tuple(request.blocks), decision)
    for outcome, prompt in zip(outcomes, prompts, strict=True):
        found = first.get(tuple(hash_blocks(prompt, BLOCK_TOKENS)))
        if found is not None:
            outcome.predicted_ttft_s, outcome.queued = found.ttft_s, found.queued


async def _burst(api: str, prompts: list[list[int]], max_tokens: int) -> list[Outcome]:
    outcomes = [Outcome(i) for i in range(len(prompts))]
    await asyncio.gather(*(_complete(api, i, prompts[i], max_tokens, outcomes[i]) for i in range(len(prompts))))
    return outcomes


async def _complete(api: str, index: int, prompt: list[int], max_tokens: int, outcome: Outcome) -> Outcome:
    """One streaming greedy completion: its status, TTFT (to the first text) and text."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client,
        client.stream("POST", api + "/v1/completions", json=body) as response,
    ):
        outcome.status = response.status_code
        if response.status_code != 200:
            error = json.loads(await response.aread()).get("error", {})
            outcome.reason, outcome.message = str(error.get("code", "")), str(error.get("message", ""))
            return outcome
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0].get("text", "")
            if not outcome.ttft_s:
                outcome.ttft_s = time.perf_counter() - start
            outcome.text += text
    return outcome


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tsukimi.bench.kv_burst", description=__doc__.split("\n")[0])
    d = BurstConfig()
    parser.add_argument("--requests", type=int, default=d.requests)
    parser.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--ttft-slo", type=float, default=d.ttft_slo_s)
    parser.add_argument("--kv-cache-memory", default=d.kv_cache_memory)
    parser.add_argument("--decode-num-blocks", type=int, default=d.decode_num_blocks)
    parser.add_argument("--no-kv-wait", action="store_true", help="reject at once what lacks decode KV memory")
    parser.add_argument("--warm-up", action="store_true", help="one short request before the burst")
    parser.add_argument(
        "--prefill-token-s", type=float, default=0.0, help="the router's prefill s per prompt token (0: its default)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = BurstConfig(
        args.requests,
        args.prompt_tokens,
        args.max_tokens,
        args.ttft_slo,
        args.kv_cache_memory,
        args.decode_num_blocks,
        kv_wait=not args.no_kv_wait,
        warm_up=args.warm_up,
        prefill_token_s=args.prefill_token_s,
    )
    result = run_burst(cfg)
    if args.json:
        print(
            json.dumps(
                {"config": asdict(cfg), "figures": result.summary(), "outcomes": [asdict(o) for o in result.outcomes]}
            )
        )
    else:
        for key, value in result.summary().items():
            print(f"{key:28} {value}")


if __name__ == "__main__":
    main()
