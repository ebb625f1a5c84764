"""`tsukimi bench layerwise`: TTFT of a request whose long prefix is in the KV pool, with the
pool's blocks loaded layer by layer during the forward (tsukimi/engine/layer_loading.py) vs
all of them before it.

A store (a master and one holder, real processes on loopback, as `tsukimi up` runs them) holds
the `prefix_tokens` prefix, published by a prefill engine. Each repeat, in alternating order,
a fresh engine (empty local cache, its own store client: a worker that has never seen the
prefix) gets the prefix plus `new_tokens` new tokens and is timed from `add_request` to its
first token:

- layerwise: probe, then one load batch per layer, overlapped with the forward;
- whole: every layer loaded at admission, then the forward (the baseline);
- compute: no pool, the whole prompt computed (what the pool saves; timed once, it is slow);

and, to read the others by: load only (all blocks into a fresh cache, no forward), and
compute only (the same new tokens with the prefix already in the local cache). Perfect
overlap would make layerwise about max(load, compute) where whole is their sum.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tsukimi.bench.measure import Spread, repeat
from tsukimi.bench.report import BenchReport, FigureViews, begin, finish
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.kv_pool import KVFormat, StoreKVConnector
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel, load_model
from tsukimi.scheduler.block_hash import hash_blocks
from tsukimi.store.client import StoreClient
from tsukimi.testing.deployments import TsukimiCluster

MODES = ("layerwise", "whole")


@dataclass(frozen=True, slots=True)
class LayerwiseBenchConfig:
    model: str = "tiny"
    prefix_tokens: int = 2048
    new_tokens: int = 16
    block_tokens: int = 16
    repeats: int = 5
    dtype: str = "float32"


class _Bench:
    """One model, one store, the prompts; `ttft_s(mode)` times one fresh engine."""

    def __init__(self, cfg: LayerwiseBenchConfig, loaded: LoadedModel, master: str) -> None:
        self.cfg, self.loaded, self.master = cfg, loaded, master
        mc = loaded.config
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_tokens, mc.torch_dtype)
        self.format = KVFormat.of(mc.identity, self.layout)
        self.prefix = [(7 * i + 3) % (mc.vocab_size - 10) + 5 for i in range(cfg.prefix_tokens)]
        self.num_blocks = -(-(cfg.prefix_tokens + cfg.new_tokens + 1) // cfg.block_tokens) * 2
        self._serial = 0

    def engine(self, client: StoreClient | None, layerwise: bool) -> LLMEngine:
        connector = None if client is None else StoreKVConnector(client, self.format)
        mc = self.loaded.config
        return LLMEngine(
            self.loaded.model,
            self.layout,
            self.num_blocks,
            mc.eos_token_ids,
            512,
            connector,
            layerwise_loading=layerwise,
        )

    def new_suffix(self) -> list[int]:
        self._serial += 1
        return [(self._serial * 131 + i) % 1000 + 10 for i in range(self.cfg.new_tokens)]

    def publish(self) -> None:
        with StoreClient.connect(self.master) as client:
            engine = self.engine(client, layerwise=False)
            first_token_s(engine, self.prefix + self.new_suffix())
            assert engine.connector is not None
            engine.connector.flush()

    def ttft_s(self, mode: str) -> float:
        """Time to first token of prefix + new tokens on a fresh engine (a fresh store client)."""
        gc.collect()  # NOTE: the previous engine's cache is freed before this one is timed
        with StoreClient.connect(self.master) as client:
            engine = self.engine(None if mode == "compute" else client, layerwise=mode == "layerwise")
            try:
                return first_token_s(engine, self.prefix + self.new_suffix())
            finally:
                if engine.loader is not None:
                    engine.loader.close()
                if isinstance(engine.connector, StoreKVConnector):
                    engine.connector.close()

    def compute_only_s(self) -> float:
        """The new tokens alone: the prefix already in the engine's local cache."""
        engine = self.engine(None, layerwise=False)
        first_token_s(engine, self.prefix + self.new_suffix())
        return first_token_s(engine, self.prefix + self.new_suffix())

    def load_only_s(self) -> float:
        """Every layer of every prefix block into a fresh cache, nothing else."""
        hashes = hash_blocks(self.prefix, self.cfg.block_tokens)
        with StoreClient.connect(self.master) as client:
            cache = PagedKVCache(self.layout, self.num_blocks)
            connector = StoreKVConnector(client, self.format)
            start = time.perf_counter()
            loaded = connector.load(hashes, list(range(len(hashes))), cache)
            elapsed = time.perf_counter() - start
        assert loaded == len(hashes), f"only {loaded} of {len(hashes)} prefix blocks in the pool"
        return elapsed


def first_token_s(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from add_request to the first token of `prompt`."""
    start = time.perf_counter()
    engine.add_request(f"r{start}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_work():
        if any(out.token_ids for out in engine.step()):
            return time.perf_counter() - start
    raise AssertionError("no token")


def run_bench(cfg: LayerwiseBenchConfig, say: Callable[[str], None] = print) -> dict[str, object]:
    """Measure every mode `cfg.repeats` times (after one warm-up round; tsukimi/bench/measure.py);
    the figures: medians and minima in ms."""
    torch.set_num_threads(1)
    loaded = load_model(cfg.model, cfg.dtype)  # type: ignore[arg-type]
    kv_bytes = loaded.config.kv_bytes_per_token * cfg.prefix_tokens
    with TsukimiCluster(holder_bytes=max(64 << 20, 3 * kv_bytes), num_holders=1) as cluster:
        bench = _Bench(cfg, loaded, cluster.master_addr)
        bench.publish()

        def one_round(index: int) -> dict[str, float]:
            order = MODES if index % 2 == 0 else MODES[::-1]  # NOTE: alternating, the warm-up (-1) reversed
            figures = {mode: bench.ttft_s(mode) for mode in order}
            figures["load_only"], figures["compute_only"] = bench.load_only_s(), bench.compute_only_s()
            say(f"round {index + 1}: " + ", ".join(f"{m} {v * 1e3:.1f} ms" for m, v in figures.items()))
            return figures

        rounds = repeat(one_round, warmup_runs=1, repeats=cfg.repeats)
        samples = {mode: [r[mode] for r in rounds] for mode in (*MODES, "load_only", "compute_only")}
        samples["compute"] = [bench.ttft_s("compute")]
    spreads = {mode: Spread.of(v) for mode, v in samples.items()}
    return {
        "model": cfg.model,
        "prefix_tokens": cfg.prefix_tokens,
        "new_tokens": cfg.new_tokens,
        "repeats": cfg.repeats,
        "kv_bytes": kv_bytes,
        "median_ms": {mode: s.median * 1e3 for mode, s in spreads.items()},
        "min_ms": {mode: s.low * 1e3 for mode, s in spreads.items()},
    }


def run_report(cfg: LayerwiseBenchConfig, say: Callable[[str], None] = print) -> BenchReport:
    """`tsukimi bench layerwise`: run (see `run_bench`) and report (no stated goal: the
    figures are read against each other)."""
    start = begin("bench layerwise", cfg)
    return finish(start, run_bench(cfg, say))


def markdown(figures: Mapping[str, object]) -> str:
    """The figures as the table docs/benchmarks.md holds (pure)."""
    median, low = figures["median_ms"], figures["min_ms"]
    assert isinstance(median, dict) and isinstance(low, dict)
    whole = median["whole"]
    lines = [
        f"model {figures['model']}, {figures['prefix_tokens']}-token pooled prefix "
        f"({int(str(figures['kv_bytes'])) / 2**20:.1f} MiB of KV) + {figures['new_tokens']} new tokens, "
        f"{figures['repeats']} repeats.",
        "",
        "| TTFT | median | min | vs whole |",
        "|---|---|---|---|",
    ]
    names = {
        "layerwise": "pooled prefix, layer-wise loading",
        "whole": "pooled prefix, loaded whole first (default)",
        "compute": "no pool: whole prompt computed (1 run)",
        "load_only": "(load only: every block, no forward)",
        "compute_only": "(compute only: prefix in the local cache)",
    }
    for mode, name in names.items():
        lines.append(f"| {name} | {median[mode]:.1f} ms | {low[mode]:.1f} ms | {median[mode] / whole:.2f}x |")
    return "\n".join(lines)


VIEWS = FigureViews(markdown)
