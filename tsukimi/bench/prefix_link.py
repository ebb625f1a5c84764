"""`tsukimi bench prefix-link`: a pooled prefix read across a shaped link vs recomputing it,
measured, next to the Conductor's TTFT estimate of each and its pick (issue 24, item 4).

    hub ------+-----------+            one bridge; both links shaped (tbf, each way) to each
              |           |            rate of `link_rates` in turn
            store      prefill
     master + holder    this process: the prefill engine and its store client
     (the prefix's KV)  (tsukimi/engine: the worker's engine, one torch thread)

The prefix (`prefix_tokens`, whole `block_tokens` blocks) is published to the pool once, the
link unshaped. Then, per link rate, after a warm-up read of the whole prefix (its time and the
link's kernel byte counters give the measured fetch rate), `repeats` rounds, in alternating
order, of one request (prefix + `new_tokens` fresh tokens) on an engine whose local cache was
just emptied (a worker that does not hold the prefix), timed from `add_request` to its first
token:

  fetch      the engine's KV connector on the pool: every layer of the prefix's blocks read
             at admission (StoreKVConnector.load, as a prefill worker does), then the rest
  recompute  no connector: the whole prompt computed in `chunk_tokens` chunks

and after each, a second request on the same engine, the prefix in its local cache then: the
new tokens' compute alone (`suffix_ttft_s`), so that fetch TTFT - the warm-up read - that is
what a fetch costs beyond its bytes and compute (`fetch_overhead_s`).

NOTE: live serving cannot force either per request (a worker reads whatever the pool holds),
so this drives the prefill worker's code path (LLMEngine + StoreKVConnector) directly.

The Conductor's side (prefix_link_estimate.py): the engine's start-up profile and step meter,
as a worker's, and before each request the Conductor's decision for it, as the router would
make it then (queue 0; the prefix in its index at the pool; `kv_bandwidth_bytes_s` the shaped
rate, and apart the measured one). Figures and goals: prefix_link_report.py.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tsukimi.bench.layerwise import first_token_s
from tsukimi.bench.prefix_link_estimate import PREFILL, Estimate, RequestShape, WorkerEstimates
from tsukimi.bench.prefix_link_report import goals
from tsukimi.bench.report import BenchReport, begin, finish
from tsukimi.config import MasterConfig
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.kv_pool import KVFormat, StoreKVConnector
from tsukimi.engine.weights import LoadedModel, load_model
from tsukimi.errors import ConfigError
from tsukimi.lab import HOST_ID_ENV, Lab, LinkShape, Topology
from tsukimi.lab.counters import nic_bytes
from tsukimi.lab.topology import parse_rate
from tsukimi.scheduler.block_hash import hash_blocks
from tsukimi.store.client import StoreClient
from tsukimi.store.replica_io import LEASE_SHARE
from tsukimi.testing.lab_store import start_spread_store

STORE = "store"
# NOTE: a store batch's reads must end within this share of its lease: with the master's default
# lease, one longer batch fails whole (the link is shared by all its objects). The worker's load
# reads in batches sized to the link (engine/kv_pool.py `_read_groups`); the bench's link check
# reads the prefix in one batch, hence its long lease.
DEFAULT_READ_LIMIT_S = LEASE_SHARE * MasterConfig().lease_ttl_s
MODES = ("fetch", "recompute")
Row = dict[str, object]


@dataclass(frozen=True, slots=True)
class PrefixLinkConfig:
    """One run: the model, the request's shape, the link rates (each way) and the rounds.
    `lease_s`: the master's read lease: a read must end within 0.8 of it (replica_io.py), so it
    must cover the whole prefix at the slowest link (each link's `fits_default_lease` says
    whether its read would have fitted the master's default lease)."""

    model: str = "random:smollm2-135m"
    prefix_tokens: int = 2048
    new_tokens: int = 64
    block_tokens: int = 512
    chunk_tokens: int = 512
    link_rates: tuple[str, ...] = ("25mbit", "400mbit")
    repeats: int = 3
    dtype: str = "float32"
    lease_s: float = 120.0

    def __post_init__(self) -> None:
        if self.prefix_tokens < self.block_tokens or self.prefix_tokens % self.block_tokens:
            raise ConfigError(f"--prefix-tokens must be whole blocks of {self.block_tokens} tokens")
        if self.new_tokens < 1 or self.repeats < 1 or self.chunk_tokens < 1:
            raise ConfigError("--new-tokens, --repeats and the chunk must be >= 1")
        if not self.link_rates or any(parse_rate(r, "--link-rates") == 0 for r in self.link_rates):
            raise ConfigError("the bench needs shaped links: --link-rates such as 25mbit,400mbit, not unlimited")


QUICK = PrefixLinkConfig(model="tiny", link_rates=("20mbit", "400mbit"), repeats=1)


class _Requests:
    """The model, the prompts, one store client and two metered engines, each long-lived as a
    worker's: one with the KV pool (fetch), one without (recompute)."""

    def __init__(self, cfg: PrefixLinkConfig, loaded: LoadedModel, client: StoreClient) -> None:
        mc = loaded.config
        self.cfg, self.loaded = cfg, loaded
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_tokens, mc.torch_dtype)
        self.connector = StoreKVConnector(client, KVFormat.of(mc.identity, self.layout))
        self.prefix = [(7 * i + 3) % (mc.vocab_size - 10) + 5 for i in range(cfg.prefix_tokens)]
        hashes = tuple(hash_blocks(self.prefix, cfg.block_tokens))
        self.shape = RequestShape(cfg.prefix_tokens, cfg.new_tokens, cfg.block_tokens, cfg.chunk_tokens, hashes)
        self.num_blocks = -(-(cfg.prefix_tokens + cfg.new_tokens + 1) // cfg.block_tokens) + 1
        self.worker = WorkerEstimates(loaded.model, self.layout, cfg.chunk_tokens)
        self.engines = {"fetch": self._engine(pooled=True), "recompute": self._engine(pooled=False)}
        self._serial = 0

    @property
    def prefix_bytes(self) -> int:
        """What a fetch moves: every (block, layer) object, trailer included."""
        return len(self.shape.hashes) * self.layout.num_layers * self.layout.slot_bytes

    def prompt(self) -> list[int]:
        """The prefix and `new_tokens` tokens no earlier prompt had."""
        self._serial += 1
        return self.prefix + [(self._serial * 131 + i) % 1000 + 10 for i in range(self.cfg.new_tokens)]

    def _engine(self, pooled: bool) -> LLMEngine:
        mc, connector = self.loaded.config, self.connector if pooled else None
        engine = LLMEngine(
            self.loaded.model, self.layout, self.num_blocks, mc.eos_token_ids, self.cfg.chunk_tokens, connector
        )
        return self.worker.metered(engine)

    def publish(self) -> None:
        """One request on the pooled engine: its prefix blocks go to the pool. Raises
        AssertionError when the pool does not then hold every block."""
        first_token_s(self.engines["fetch"], self.prompt())
        self.connector.flush()
        held = self.connector.probe(self.shape.hashes)
        assert held == len(self.shape.hashes), f"the pool holds {held} of the prefix's {len(self.shape.hashes)} blocks"

    def ttft_s(self, mode: str) -> tuple[float, float]:
        """TTFT of one request on `mode`'s engine ("fetch": pooled, "recompute": not), its
        local cache emptied first (a worker that does not hold the prefix), and of a second one
        after it, the prefix in its local cache then (the new tokens' compute alone). Raises
        AssertionError when the fetch did not read the whole prefix from the pool."""
        engine = self.engines[mode]
        engine.cache.pool.drop_cached()
        gc.collect()  # NOTE: no collection inside the timed part
        loaded_before = self.connector.loaded_blocks
        seconds = first_token_s(engine, self.prompt())
        fetched = self.connector.loaded_blocks - loaded_before
        want = len(self.shape.hashes) if mode == "fetch" else 0
        assert fetched == want, f"{mode}: {fetched} blocks loaded from the pool, expected {want}"
        return seconds, first_token_s(engine, self.prompt())

    def load_s(self) -> float:
        """Every layer of every prefix block into a fresh cache, nothing else (the fetch alone)."""
        cache, hashes = PagedKVCache(self.layout, self.num_blocks), self.shape.hashes
        start = time.perf_counter()
        loaded = self.connector.load(hashes, list(range(len(hashes))), cache)
        elapsed = time.perf_counter() - start
        assert loaded == len(hashes), f"only {loaded} of {len(hashes)} prefix blocks read from the pool"
        return elapsed


@dataclass(slots=True)
class _Samples:
    """Per option: the measured TTFTs and the estimates made just before each."""

    measured: dict[str, list[float]]
    estimates: dict[str, list[Estimate]]
    at_measured_rate: dict[str, list[Estimate]]
    suffix_s: list[float]

    def error(self, mode: str, at_measured_rate: bool = False) -> float:
        """The median over the requests of estimated / measured - 1."""
        made = (self.at_measured_rate if at_measured_rate else self.estimates)[mode]
        return statistics.median(e.of(mode) / m - 1 for e, m in zip(made, self.measured[mode], strict=True))

    def median(self, mode: str, what: str) -> float:
        """The median of field `what` of the estimates made before `mode`'s requests."""
        return statistics.median(float(getattr(e, what)) for e in self.estimates[mode])


def measure_link(lab: Lab, requests: _Requests, rate: str, say: Callable[[str], None]) -> Row:
    """Shape both links to `rate`, then the warm-up read and the rounds, each request estimated
    just before it runs."""
    for host in (STORE, PREFILL):
        lab.set_link(host, 0, rate=rate)
    before = nic_bytes(lab, PREFILL)
    load_s = requests.load_s()
    wire_bytes = (nic_bytes(lab, PREFILL) - before).rx_bytes
    rate_bytes_s, fetch_rate = parse_rate(rate) / 8, requests.prefix_bytes / load_s
    say(f"{rate}: the prefix ({requests.prefix_bytes / 2**20:.1f} MiB) read in {load_s:.2f} s")
    got = _Samples({m: [] for m in MODES}, {m: [] for m in MODES}, {m: [] for m in MODES}, [])
    for index in range(requests.cfg.repeats):
        for mode in MODES if index % 2 == 0 else MODES[::-1]:
            got.estimates[mode].append(requests.worker.estimate(requests.shape, rate_bytes_s))
            got.at_measured_rate[mode].append(requests.worker.estimate(requests.shape, fetch_rate))
            ttft_s, suffix_s = requests.ttft_s(mode)
            got.measured[mode].append(ttft_s)
            got.suffix_s.append(suffix_s)
        say(f"{rate} round {index + 1}: " + ", ".join(f"{m} {got.measured[m][-1]:.2f} s" for m in MODES))
    return _link_row(requests, rate, (load_s, wire_bytes), got)


def _link_row(requests: _Requests, rate: str, read: tuple[float, int], got: _Samples) -> Row:
    """The figures of one link (see prefix_link_report.py)."""
    load_s, wire_bytes = read
    rate_bytes_s, fetch_rate = parse_rate(rate) / 8, requests.prefix_bytes / load_s
    measured = {mode: statistics.median(v) for mode, v in got.measured.items()}
    suffix_s = statistics.median(got.suffix_s)
    picks = Counter(e.pick for made in got.estimates.values() for e in made)
    return {
        "link_rate": rate,
        "link_bytes_s": rate_bytes_s,
        "prefix_bytes": requests.prefix_bytes,
        "load_s": round(load_s, 4),
        "fetch_bytes_s": round(fetch_rate),
        "fetch_x_link": round(fetch_rate / rate_bytes_s, 3),
        "wire_bytes": wire_bytes,
        "wire_x_link": round(wire_bytes / load_s / rate_bytes_s, 3),
        "fetch_ttft_s": round(measured["fetch"], 4),
        "recompute_ttft_s": round(measured["recompute"], 4),
        "suffix_ttft_s": round(suffix_s, 4),
        "fetch_overhead_s": round(measured["fetch"] - load_s - suffix_s, 4),
        "fits_default_lease": load_s <= DEFAULT_READ_LIMIT_S,
        "samples_s": {mode: [round(v, 4) for v in got.measured[mode]] for mode in MODES},
        "faster": "fetch" if measured["fetch"] < measured["recompute"] else "recompute",
        "estimate": {
            "pick": picks.most_common(1)[0][0],
            "picks": dict(picks),
            "fetch_s": round(got.median("fetch", "fetch_s"), 4),
            "transfer_s": round(got.median("fetch", "transfer_s"), 4),
            "recompute_s": round(got.median("recompute", "recompute_s"), 4),
            "prefill_slowdown": round(got.median("recompute", "slowdown"), 3),
        },
        "fetch_error": round(got.error("fetch"), 4),
        "recompute_error": round(got.error("recompute"), 4),
        "fetch_error_at_measured_rate": round(got.error("fetch", at_measured_rate=True), 4),
        "load_avg_1m": os.getloadavg()[0],
    }


@contextmanager
def _host_identity(identity: str) -> Iterator[None]:
    """This process reports `identity` (its store client's segment: tcp to the other host)."""
    before = os.environ.get(HOST_ID_ENV)
    os.environ[HOST_ID_ENV] = identity
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HOST_ID_ENV, None)
        else:
            os.environ[HOST_ID_ENV] = before


def run(cfg: PrefixLinkConfig, say: Callable[[str], None] = lambda _: None) -> Row:
    """Build the lab, publish the prefix, profile the engine, measure every link rate, tear it
    all down; the figures (see the module).

    Raises:
        ConfigError: no namespaces here (naming what is missing).
        PeerError / OSError: the store did not come up.
    """
    torch.set_num_threads(1)  # NOTE: as a worker's engine thread runs
    loaded = load_model(cfg.model, cfg.dtype)  # type: ignore[arg-type]
    kv_bytes = loaded.config.kv_bytes_per_token * cfg.prefix_tokens
    topology = Topology.of(STORE, PREFILL, link=LinkShape(rate_bps=0))
    say(f"building the lab: {STORE} (master + holder), {PREFILL} (the engine); profiling the engine")
    with Lab(topology) as lab, lab.entered(PREFILL), _host_identity(lab.host_id(PREFILL)):
        log_dir = Path(tempfile.mkdtemp(prefix="tsukimi-prefix-link-"))
        lease = (f"lease_ttl_s={cfg.lease_s}", f"put_timeout_s={cfg.lease_s}")
        store = start_spread_store(lab, STORE, [STORE], PREFILL, log_dir, 2 * kv_bytes + (64 << 20), lease)
        try:
            requests = _Requests(cfg, loaded, store.deployment.client())
            say("publishing the prefix (links unshaped)")
            requests.publish()
            links = [measure_link(lab, requests, rate, say) for rate in cfg.link_rates]
        finally:
            store.close()
        hosts = [{"name": h, "address": lab.address(h)} for h in (STORE, PREFILL)]
    return {
        "topology": {
            "hosts": hosts,
            "roles": {STORE: "store master + holder of the prefix", PREFILL: "prefill engine + store client"},
            "shaping": "tbf, each way, on both hosts' links",
        },
        "model": cfg.model,
        "kv_bytes_per_token": loaded.config.kv_bytes_per_token,
        "input_tokens": cfg.prefix_tokens + cfg.new_tokens,
        "cost_model": requests.worker.profile.as_dict(),
        "bandwidth": "estimate: the shaped rate; estimate_at_measured_rate: the warm-up read's rate",
        "lease_s": cfg.lease_s,
        "default_read_limit_s": DEFAULT_READ_LIMIT_S,
        "links": links,
    }


def run_report(cfg: PrefixLinkConfig, say: Callable[[str], None] = lambda _: None) -> BenchReport:
    """`tsukimi bench prefix-link`: run (see `run`) and report, the issue's goals as verdicts
    (prefix_link_report.py).

    Raises:
        As `run`.
    """
    start = begin("bench prefix-link", cfg)
    figures = run(cfg, say)
    links = figures["links"]
    assert isinstance(links, list)
    return finish(start, figures, goals(links))
