"""How fast a vLLM decode instance gets a prompt's KV through tsukimi: PD "direct" (the
consumer READs the producer's KV buffer with the Transfer Engine) against PD "pool" (the
producer saves, the consumer loads by block hash) and against recomputing the prompt.

    python -m tsukimi.bench.vllm_pd --model .models/tiny --num-prompts 8 --prompt-tokens 1024 [--json]

Starts a store (master + one holder), a producer (kv_producer, CPU 0) and a consumer
(kv_consumer, CPU 1) vLLM API server, warms both up, then for each prompt:

    alone    the consumer computes the prompt itself (one token): the reference token and time
    direct   prefill on the producer (one token), decode on the consumer with its params
    pool     the same through the pool, on a fresh prompt of the same length

Decode times are the consumer's whole request (HTTP, scheduling, the load, the tail of the
prompt it computes, one token), client-side; the connector's own load times come from its
DEBUG line per load (TSUKIMI_LOG_LEVEL=DEBUG), from the start of the read to its end.
`--no-save-per-layer` makes the producer put whole blocks at wait_for_save instead of layer by
layer. Greedy first tokens must equal the consumer's own; the run says whether they did.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

from tsukimi.integrations.vllm import paths
from tsukimi.netio import free_port
from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.vllm_server import (
    VllmServer,
    VllmServerConfig,
    connector_config,
    pd_handover,
    start_servers,
)

BLOCK_SIZE = 128


def _prompt(seed: int, num_tokens: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(num_tokens)]


def _git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _load_ms(server: VllmServer, source: str) -> list[float]:
    """The consumer connector's own time per load (its DEBUG lines), in ms."""
    pattern = rf"loaded \S+: \d+ blocks from {source} in ([0-9.]+) ms"
    return [float(m) for m in re.findall(pattern, server.log_text())]


def _stat_sums(log: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums over a server's "KV Transfer metrics" lines (vLLM logs the connector stats)."""
    sums = dict.fromkeys(names, 0.0)
    for line in re.findall(r"KV Transfer metrics: (.*)", log):
        for name, value in re.findall(r"(\w+)=([0-9.e-]+)", line):
            if name in sums:
                sums[name] += float(value)
    return {name: round(value, 6) for name, value in sums.items()}


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, measure, stop everything; the figures as one JSON-able dict."""
    env = {"VLLM_LOG_STATS_INTERVAL": "1", "TSUKIMI_LOG_LEVEL": "DEBUG"}
    with TsukimiCluster(512 << 20, num_holders=1) as cluster:
        extra: dict[str, object] = {"master": cluster.master_addr, "save_per_layer": args.save_per_layer}
        producer_cfg = VllmServerConfig(
            model=args.model,
            cpus="0",
            env=env,
            connector=connector_config("kv_producer", pd_port=free_port(), **extra),
        )
        consumer_cfg = VllmServerConfig(
            model=args.model, cpus="1", env=env, connector=connector_config("kv_consumer", master=cluster.master_addr)
        )
        producer, consumer = start_servers(producer_cfg, consumer_cfg)
        with producer, consumer:
            for seed in range(2):  # warm-up: compile paths, first contacts
                warm = _prompt(900 + seed, args.prompt_tokens)
                pd_handover(producer, consumer, warm, 1, "direct")
                pd_handover(producer, consumer, _prompt(950 + seed, args.prompt_tokens), 1, "pool")
            rows: dict[str, list[float]] = {
                "alone": [],
                "direct": [],
                "pool": [],
                "prefill_direct": [],
                "prefill_pool": [],
            }
            equal = True
            loaded = {"direct": 0, "pool": 0}
            for i in range(args.num_prompts):
                for mode, seed in (("direct", 1000 + i), ("pool", 2000 + i)):
                    text = _prompt(seed, args.prompt_tokens)
                    alone = consumer.complete(text, 1)
                    prefill, decode = pd_handover(producer, consumer, text, 1, mode)
                    rows["alone"].append(alone.seconds)
                    rows[mode].append(decode.seconds)
                    rows[f"prefill_{mode}"].append(prefill.seconds)
                    equal = equal and decode.token_ids == alone.token_ids and alone.cached_tokens == 0
                    loaded[mode] += decode.cached_tokens
            num_warm = 2  # the warm-up's loads per mode come first
            load_ms = {mode: _p50(_load_ms(consumer, mode)[num_warm:]) for mode in ("direct", "pool")}
            saves = _stat_sums(producer.log_text(), ("num_puts", "put_objects", "put_s", "save_wait_s"))
    expected = args.num_prompts * ((args.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)
    return {
        "model": str(args.model),
        "prompt_tokens": args.prompt_tokens,
        "num_prompts": args.num_prompts,
        "save_per_layer": args.save_per_layer,
        "git": _git_revision(),
        "decode_p50_ms": {k: round(1000 * statistics.median(v), 2) for k, v in rows.items() if v},
        "tokens_equal": equal,
        "loaded_tokens": loaded,
        "expected_loaded_tokens_per_mode": expected,
        "consumer_load_ms_p50": load_ms,
        "producer_saves": saves,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="PD hand-over through tsukimi: direct vs pool vs recompute")
    parser.add_argument("--model", type=Path, default=paths.models_dir() / "tiny")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--no-save-per-layer", dest="save_per_layer", action="store_false")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    print(f"model {result['model']}, {args.num_prompts} prompts of {args.prompt_tokens} tokens, git {result['git']}")
    print(f"{'request (one token)':<30} p50 ms")
    for name, value in result["decode_p50_ms"].items():
        print(f"{name:<30} {value}")
    expected = result["expected_loaded_tokens_per_mode"]
    print(f"tokens equal: {result['tokens_equal']}; loaded {result['loaded_tokens']} (expected {expected} each)")
    print(f"the consumer connector's own load time, p50 ms: {result['consumer_load_ms_p50']}")
    print(f"producer saves (whole run, warm-up included): {result['producer_saves']}")


if __name__ == "__main__":
    main()
