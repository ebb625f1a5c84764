"""`tsukimi bench vllm-pd`: how fast a vLLM decode instance gets a prompt's KV through tsukimi:
PD "direct" (the consumer READs the producer's KV buffer with the Transfer Engine) against PD
"pool" (the producer saves, the consumer loads by block hash) and against recomputing the prompt.

    tsukimi bench vllm-pd --model .models/tiny --num-prompts 8 --prompt-tokens 1024 [--json]

Starts a store (master + one holder), a producer (kv_producer, CPU 0) and a consumer
(kv_consumer, CPU 1) vLLM API server, warms both up, then for each prompt:

    alone    the consumer computes the prompt itself (one token): the reference token and time
    direct   prefill on the producer (one token), decode on the consumer with its params
    pool     the same through the pool, on a fresh prompt of the same length

Decode times are the consumer's whole request (HTTP, scheduling, the load, the tail of the
prompt it computes, one token), client-side; the connector's own load times come from its
DEBUG line per load (TSUKIMI_LOG_LEVEL=DEBUG), from the start of the read to its end.
`--no-save-per-layer` makes the producer put whole blocks at wait_for_save instead of layer by
layer. Greedy first tokens must equal the consumer's own: the report's verdict `tokens_equal`.
`--quick`: 1 prompt of 512 tokens (3 blocks handed over).

The vLLM API servers run under .venv-vllm (tsukimi/testing/vllm_server.py), the store is the
test kit's `TsukimiCluster`; this process only drives them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tsukimi.bench.measure import Spread
from tsukimi.bench.report import BenchReport, Figures, FigureViews, Verdict, begin, finish
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


@dataclass(frozen=True, slots=True)
class VllmPdBenchConfig:
    """`model`: a model folder ("": tiny under the models folder, $TSUKIMI_MODELS_DIR or
    ./.models; tsukimi/integrations/vllm/paths.py); prompts of `prompt_tokens` each;
    `save_per_layer` False: the producer puts whole blocks at wait_for_save."""

    model: str = ""
    num_prompts: int = 8
    prompt_tokens: int = 1024
    save_per_layer: bool = True


QUICK = VllmPdBenchConfig(num_prompts=1, prompt_tokens=512)


def _model(cfg: VllmPdBenchConfig) -> Path:
    return Path(cfg.model) if cfg.model else paths.models_dir() / "tiny"


def _prompt(seed: int, num_tokens: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(num_tokens)]


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
    return round(Spread.of(values).median, 3)


def run(cfg: VllmPdBenchConfig, progress: Callable[[str], None] = lambda _: None) -> dict[str, object]:
    """Start everything, measure, stop everything; the figures."""
    env = {"VLLM_LOG_STATS_INTERVAL": "1", "TSUKIMI_LOG_LEVEL": "DEBUG"}
    with TsukimiCluster(512 << 20, num_holders=1) as cluster:
        extra: dict[str, object] = {"master": cluster.master_addr, "save_per_layer": cfg.save_per_layer}
        producer_cfg = VllmServerConfig(
            model=_model(cfg),
            cpus="0",
            env=env,
            connector=connector_config("kv_producer", pd_port=free_port(), **extra),
        )
        consumer_cfg = VllmServerConfig(
            model=_model(cfg),
            cpus="1",
            env=env,
            connector=connector_config("kv_consumer", master=cluster.master_addr),
        )
        progress("starting the producer and the consumer vLLM servers")
        producer, consumer = start_servers(producer_cfg, consumer_cfg)
        with producer, consumer:
            return measure(cfg, producer, consumer)


def measure(cfg: VllmPdBenchConfig, producer: VllmServer, consumer: VllmServer) -> dict[str, object]:
    """Warm up, then time every prompt three ways (see the module); the figures.

    Args:
        cfg: the prompts (its model must be the one the servers serve).
        producer / consumer: running servers, kv_producer (with a `pd_port`) and kv_consumer
            on one store, both logging at TSUKIMI_LOG_LEVEL=DEBUG with VLLM_LOG_STATS_INTERVAL
            set (the load times and the saves come from their logs). Servers that served
            before are fine: only their log lines from here on count.
    """
    # NOTE: what the logs held before this run is not this run's (`run`'s servers are fresh;
    # the test suite measures on servers its other tests used)
    loads_before = {mode: len(_load_ms(consumer, mode)) for mode in ("direct", "pool")}
    producer_log_start = len(producer.log_text())
    for seed in range(2):  # warm-up: compile paths, first contacts
        warm = _prompt(900 + seed, cfg.prompt_tokens)
        pd_handover(producer, consumer, warm, 1, "direct")
        pd_handover(producer, consumer, _prompt(950 + seed, cfg.prompt_tokens), 1, "pool")
    rows: dict[str, list[float]] = {
        "alone": [],
        "direct": [],
        "pool": [],
        "prefill_direct": [],
        "prefill_pool": [],
    }
    equal = True
    loaded = {"direct": 0, "pool": 0}
    for i in range(cfg.num_prompts):
        for mode, seed in (("direct", 1000 + i), ("pool", 2000 + i)):
            text = _prompt(seed, cfg.prompt_tokens)
            alone = consumer.complete(text, 1)
            prefill, decode = pd_handover(producer, consumer, text, 1, mode)
            rows["alone"].append(alone.seconds)
            rows[mode].append(decode.seconds)
            rows[f"prefill_{mode}"].append(prefill.seconds)
            equal = equal and decode.token_ids == alone.token_ids and alone.cached_tokens == 0
            loaded[mode] += decode.cached_tokens
    num_warm = 2  # the warm-up's loads per mode come first
    load_ms = {mode: _p50(_load_ms(consumer, mode)[loads_before[mode] + num_warm :]) for mode in ("direct", "pool")}
    saves = _stat_sums(producer.log_text()[producer_log_start:], ("num_puts", "put_objects", "put_s", "save_wait_s"))
    expected = cfg.num_prompts * ((cfg.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)
    return {
        "model": str(_model(cfg)),
        "prompt_tokens": cfg.prompt_tokens,
        "num_prompts": cfg.num_prompts,
        "decode_p50_ms": {k: round(1000 * Spread.of(v).median, 2) for k, v in rows.items() if v},
        "tokens_equal": equal,
        "loaded_tokens": loaded,
        "expected_loaded_tokens_per_mode": expected,
        "consumer_load_ms_p50": load_ms,
        "producer_saves": saves,
    }


def verdicts(figures: Figures) -> list[Verdict]:
    """Greedy first tokens equal the consumer's own, and every handed-over token was loaded. Pure."""
    loaded, expected = figures["loaded_tokens"], figures["expected_loaded_tokens_per_mode"]
    assert isinstance(loaded, dict)
    tokens = "decode after the hand-over gives the consumer's own first token"
    return [
        Verdict("tokens_equal", tokens, bool(figures["tokens_equal"])),
        Verdict(
            "all_loaded",
            "every full block of each prompt loaded by the consumer, both modes",
            all(v == expected for v in loaded.values()),
            f"loaded {loaded}, expected {expected} each",
        ),
    ]


def run_report(cfg: VllmPdBenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench vllm-pd`: run (see `run`) and report."""
    start = begin("bench vllm-pd", cfg)
    figures = run(cfg, progress)
    return finish(start, figures, verdicts(figures))


def markdown(figures: Figures) -> str:
    """The p50s per request kind, and the loads (pure)."""
    decode = figures["decode_p50_ms"]
    assert isinstance(decode, dict)
    lines = [
        f"model {figures['model']}, {figures['num_prompts']} prompts of {figures['prompt_tokens']} tokens.",
        "",
        "| request (one token) | p50 ms |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in decode.items()),
        "",
        f"loaded {figures['loaded_tokens']} (expected {figures['expected_loaded_tokens_per_mode']} each); "
        f"the consumer connector's own load time, p50 ms: {figures['consumer_load_ms_p50']}; "
        f"producer saves (whole run, warm-up included): {figures['producer_saves']}",
    ]
    return "\n".join(lines)


VIEWS = FigureViews(markdown)
