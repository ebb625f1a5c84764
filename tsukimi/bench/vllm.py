"""`tsukimi bench vllm`: two vLLM instances (one core each) under the chat workload of
`tsukimi bench serve`, served three ways, one after the other on fresh instances:

    vllm_rr          vLLM alone behind round-robin, local prefix caching on         (a)
    tsukimi          TsukimiConnector + tsukimi's pool + Conductor routing          (b)
    mooncake_store   vLLM's MooncakeStoreConnector on the real Mooncake wheel
                     (mooncake_master + MooncakeDistributedStore), round-robin      (c)
    tsukimi_routing  (extra) Conductor routing alone: local prefix caching, no pool

Each system is a `tsukimi up --engine vllm` cluster (tsukimi/integrations/vllm/launch.py)
started here, warmed with two unrelated 300-token requests per instance, then driven with the
workload: every
conversation starts with the same `prefix_tokens` system prompt; turn k sends the history
plus a new user message once turn k-1 is done. Prompts are token ids drawn from one seeded
generator per conversation, so every system gets exactly the same requests, and greedy
(temperature 0) outputs must be the same token ids everywhere. Per request: TTFT (first
streamed token), TBT (mean gap after it), cached prompt tokens (vLLM's
prompt_tokens_details.cached_tokens: local hits plus tokens a connector loaded).

Each cluster is launched in this process by the cluster launcher
(tsukimi/serving/cluster/launcher.py) from `plan_vllm`'s groups; requests go through the
bench's one client (tsukimi/bench/client.py, `return_token_ids`).

A system that cannot run (its venv, model, connector or Mooncake missing, or a process that
fails) gets its error in its row instead of figures.

Goals (docs/benchmarks.md), as the report's verdicts: p50 TTFT of (b) <= 0.5x (a) and <= 0.8x
(c); every system's greedy tokens equal (a)'s.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tsukimi.bench.client import CompletionRequest, CompletionResult, complete
from tsukimi.bench.report import BenchReport, FigureViews, Verdict, begin, finish, goal
from tsukimi.errors import ConfigError, PeerError
from tsukimi.integrations.vllm import leftovers, paths
from tsukimi.integrations.vllm.launch import VllmClusterConfig, plan_vllm
from tsukimi.netio import free_port
from tsukimi.quantiles import quantiles
from tsukimi.serving.cluster.launcher import LaunchConfig, LaunchedCluster
from tsukimi.serving.cluster.process_spec import ProcessSpec

SYSTEMS = ("vllm_rr", "tsukimi", "mooncake_store", "tsukimi_routing")
_TIMEOUT_S = 300.0
_VOCAB = (3, 250)
Turns = dict[tuple[int, int], CompletionResult]  # (conversation, turn) -> how it ended


@dataclass(frozen=True, slots=True)
class VllmBenchConfig:
    """The workload (as `tsukimi bench serve`'s chat) and which systems run on which model."""

    model: str = "tiny"
    systems: tuple[str, ...] = SYSTEMS
    conversations: int = 8
    turns: int = 4
    prefix_tokens: int = 2000
    user_tokens: int = 64
    max_tokens: int = 16
    rate: float = 2.0
    seed: int = 0
    models_dir: str = field(default_factory=lambda: str(paths.models_dir()))
    venv: str = field(default_factory=lambda: str(paths.vllm_venv()))

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ConfigError(f"unknown systems {sorted(unknown)}; choose among {SYSTEMS}")


def cluster_config(cfg: VllmBenchConfig, system: str) -> VllmClusterConfig:
    """The cluster a system runs on (pure)."""
    base = VllmClusterConfig(model=cfg.model, instances=2, venv=cfg.venv, models_dir=cfg.models_dir)
    if system == "vllm_rr":
        return replace(base, policy="round_robin")
    if system == "tsukimi":
        return replace(base, connector="tsukimi")
    if system == "mooncake_store":
        return replace(base, connector="mooncake_store", policy="round_robin")
    return base


def launch(config: VllmClusterConfig, workdir: Path) -> LaunchedCluster:
    """A `tsukimi up --engine vllm` cluster (`plan_vllm`'s groups) launched here, its router on
    another free port while the one planned minutes ago was taken meanwhile (a free port is
    only free when asked); stopped again when anything fails.

    Raises:
        ConfigError: the venv, model or connector is missing. PeerError: a process failed.
    """
    groups = plan_vllm(config, workdir)
    cluster = LaunchedCluster(
        groups[:-1], LaunchConfig(workdir, config.startup_timeout_s, config.stop_timeout_s, verbose=0)
    )
    cluster.start()
    try:
        spec = groups[-1][0]
        for attempt in range(3):
            try:
                cluster.start_group([spec])
                return cluster
            except PeerError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
                spec = _on_fresh_port(spec)
        raise AssertionError("unreachable")
    except BaseException:
        cluster.stop()
        raise


def _on_fresh_port(spec: ProcessSpec) -> ProcessSpec:
    port = spec.args[spec.args.index("--port") + 1]
    fresh = str(free_port())
    return replace(
        spec, args=tuple(fresh if a == port else a for a in spec.args), url=spec.url.rsplit(":", 1)[0] + f":{fresh}"
    )


def instances(cluster: LaunchedCluster) -> list[str]:
    """The vLLM instances' URLs (the group before the router's)."""
    groups = cluster.supervisor.groups
    return [c.spec.url for c in groups[-2]]


def conversations(cfg: VllmBenchConfig) -> list[tuple[list[int], list[list[int]], list[list[int]]]]:
    """Per conversation: the shared prefix, its user messages and the stand-in replies (pure)."""
    prefix = np.random.default_rng(cfg.seed).integers(*_VOCAB, cfg.prefix_tokens).tolist()
    out = []
    for i in range(cfg.conversations):
        rng = np.random.default_rng([cfg.seed, i + 1])
        users = [rng.integers(*_VOCAB, cfg.user_tokens).tolist() for _ in range(cfg.turns)]
        replies = [rng.integers(*_VOCAB, cfg.max_tokens).tolist() for _ in range(cfg.turns)]
        out.append((prefix, users, replies))
    return out


def _request(prompt: list[int], max_tokens: int) -> CompletionRequest:
    return CompletionRequest(tuple(prompt), max_tokens, ignore_eos=True, return_token_ids=True)


async def run_workload(cfg: VllmBenchConfig, url: str) -> Turns:
    """The chat workload against `url`; the outcome of every (conversation, turn)."""
    results: Turns = {}

    async def conversation(index: int, parts: tuple[list[int], list[list[int]], list[list[int]]]) -> None:
        await asyncio.sleep(index / cfg.rate)
        prefix, users, replies = parts
        history = list(prefix)
        for k in range(cfg.turns):
            history += users[k]
            results[(index, k)] = await complete(url, cfg.model, _request(history, cfg.max_tokens), _TIMEOUT_S)
            history += replies[k]

    await asyncio.gather(*(conversation(i, parts) for i, parts in enumerate(conversations(cfg))))
    return results


async def _warm(cfg: VllmBenchConfig, urls: list[str]) -> None:
    """Two 300-token requests straight to each instance, unrelated to the workload: full
    blocks, so that a connector's first lookup, save and pool connection (0.4 s for
    TsukimiConnector, measured) happen before measuring, as vLLM's own first-request costs do."""
    for i, url in enumerate(urls):
        for k in range(2):
            prompt = np.random.default_rng([cfg.seed, 1000 + i, k]).integers(*_VOCAB, 300).tolist()
            await complete(url, cfg.model, _request(prompt, 2), _TIMEOUT_S)


def summarize(system: str, turns: Turns, reference: Turns | None) -> dict[str, object]:
    """One row of the result (pure)."""
    ok = [t for t in turns.values() if t.kind == "served"]
    ttft_p50, ttft_p90 = quantiles((t.ttft_s for t in ok), (0.5, 0.9))
    (tbt_p50,) = quantiles((t.tbt_s for t in ok), (0.5,))
    prompt = sum(t.prompt_tokens for t in ok)
    equal = (
        None
        if reference is None
        else all(
            key in reference and t.kind == "served" and t.token_ids == reference[key].token_ids
            for key, t in turns.items()
        )
    )
    row: dict[str, object] = {
        "system": system,
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "ttft_p50_s": round(ttft_p50, 4) if ttft_p50 == ttft_p50 else None,
        "ttft_p90_s": round(ttft_p90, 4) if ttft_p90 == ttft_p90 else None,
        "tbt_p50_ms": round(tbt_p50 * 1e3, 2) if tbt_p50 == tbt_p50 else None,
        "cached_ratio": round(sum(t.cached_tokens for t in ok) / prompt, 4) if prompt else 0.0,
        "tokens_equal": equal if reference is not None else not (len(turns) - len(ok)),
    }
    first_error = next(
        (f"{t.kind}: {t.status} {t.reason} {t.message}".strip() for t in turns.values() if t.kind != "served"), ""
    )
    if first_error:
        row["error"] = first_error
    return row


def run_bench(cfg: VllmBenchConfig, progress: Callable[[str], None]) -> dict[str, object]:
    """Every system in turn (see the module); the figures."""
    runs: list[dict[str, object]] = []
    reference: Turns | None = None
    for system in cfg.systems:
        # NOTE: swept: vLLM's message-queue files in /dev/shm, once the system's processes stopped
        with tempfile.TemporaryDirectory(prefix=f"tsukimi-bench-vllm-{system}-") as workdir, leftovers.swept():
            try:
                progress(f"{system}: starting two vLLM instances and the router")
                cluster = launch(cluster_config(cfg, system), Path(workdir))
            except (ConfigError, PeerError, OSError) as exc:
                runs.append({"system": system, "error": f"{type(exc).__name__}: {exc}"})
                progress(f"{system}: could not start: {exc}")
                continue
            with cluster:
                progress(f"{system}: chat workload against {cluster.api}")
                row, turns = measure_system(cfg, system, cluster.api, instances(cluster), reference)
        runs.append(row)
        reference = reference or (turns if system == cfg.systems[0] else None)
    return {"runs": runs, "ratios": ratios(runs)}


def measure_system(
    cfg: VllmBenchConfig, system: str, api: str, instance_urls: list[str], reference: Turns | None
) -> tuple[dict[str, object], Turns]:
    """One system on its running cluster: warm each instance, run the chat workload through
    the router at `api`; its row (see `summarize`) and how every turn ended.

    Args:
        cfg: the workload; `cfg.model` is the name the cluster serves.
        system: the row's name. instance_urls: the vLLM instances (warmed directly).
        reference: the first system's turns, whose tokens the row compares (None: this is it).
    """
    asyncio.run(_warm(cfg, instance_urls))
    turns = asyncio.run(run_workload(cfg, api))
    return summarize(system, turns, reference), turns


def verdicts(figures: Mapping[str, object]) -> list[Verdict]:
    """The goals (see the module); n/a where a system did not run. Pure."""
    ratio, runs = figures["ratios"], figures["runs"]
    assert isinstance(ratio, dict) and isinstance(runs, list)
    equal = [r["tokens_equal"] for r in runs if "tokens_equal" in r]
    return [
        goal(
            "tsukimi_vs_vllm_rr",
            "p50 TTFT of tsukimi (b) / vLLM round-robin (a)",
            ratio.get("tsukimi_over_vllm_rr"),
            "<=",
            0.5,
        ),
        goal(
            "tsukimi_vs_mooncake_store",
            "p50 TTFT of tsukimi (b) / Mooncake store (c)",
            ratio.get("tsukimi_over_mooncake_store"),
            "<=",
            0.8,
        ),
        Verdict("tokens_equal", "every system's greedy tokens equal (a)'s", all(equal) if equal else None, str(equal)),
    ]


def run_report(cfg: VllmBenchConfig, progress: Callable[[str], None]) -> BenchReport:
    """`tsukimi bench vllm`: run (see `run_bench`) and report, with the goals as verdicts."""
    start = begin("bench vllm", cfg)
    figures = run_bench(cfg, progress)
    return finish(start, figures, verdicts(figures))


def ratios(runs: list[dict[str, object]]) -> dict[str, float]:
    """p50 TTFT of tsukimi over each baseline that ran (pure)."""
    p50 = {str(r["system"]): r.get("ttft_p50_s") for r in runs}
    ours = p50.get("tsukimi")
    out = {}
    for base in ("vllm_rr", "mooncake_store"):
        theirs = p50.get(base)
        if isinstance(ours, float) and isinstance(theirs, float) and theirs > 0:
            out[f"tsukimi_over_{base}"] = round(ours / theirs, 3)
    return out


def markdown(result: Mapping[str, object]) -> str:
    """The figures as the Markdown table docs/benchmarks.md holds (pure)."""
    lines = [
        "| system | TTFT p50 s | TTFT p90 s | TBT p50 ms | cached | tokens equal to (a) | note |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = result["runs"]
    assert isinstance(runs, list)
    for r in runs:
        cells = [r.get(k, "-") for k in ("ttft_p50_s", "ttft_p90_s", "tbt_p50_ms", "cached_ratio", "tokens_equal")]
        note = str(r.get("error", ""))[:160].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['system']} | " + " | ".join(str(c) for c in cells) + f" | {note} |")
    ratio = result.get("ratios") or {}
    assert isinstance(ratio, dict)
    lines += [f"\n{k}: {v}" for k, v in ratio.items()]
    return "\n".join(lines)


VIEWS = FigureViews(markdown)
