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

A system that cannot run (its venv, model, connector or Mooncake missing, or a process that
fails) gets its error in its row instead of figures.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np

from tsukimi.errors import ConfigError, PeerError
from tsukimi.integrations.vllm import paths
from tsukimi.integrations.vllm.launch import VllmClusterConfig, plan_vllm
from tsukimi.netio import free_port

if TYPE_CHECKING:
    from tsukimi.serving.cluster.process_spec import ProcessSpec

SYSTEMS = ("vllm_rr", "tsukimi", "mooncake_store", "tsukimi_routing")
_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
_VOCAB = (3, 250)


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


@dataclass(slots=True)
class Turn:
    """One request's outcome."""

    ttft_s: float = float("nan")
    tbt_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    error: str = ""


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


class BenchCluster:
    """A `tsukimi up --engine vllm` cluster supervised from this process; `api` once up."""

    def __init__(self, config: VllmClusterConfig, workdir: Path) -> None:
        from tsukimi.serving.cluster.supervisor import Supervisor

        groups = plan_vllm(config, workdir)
        self.instances = [s.url for s in groups[-2]]
        self.supervisor = Supervisor(workdir, config.stop_timeout_s, verbose=0)
        # NOTE: Supervisor deadlines read the WallClock, i.e. time.monotonic
        self._deadline = time.monotonic() + config.startup_timeout_s
        try:
            for group in groups[:-1]:
                self._start(group)
            self.api = self._start_router(groups[-1][0])
        except BaseException:
            self.close()
            raise

    def _start(self, group: Sequence[ProcessSpec]) -> None:
        self.supervisor.start_group(group)
        self.supervisor.wait_ready(self.supervisor.groups[-1], self._deadline, threading.Event(), lambda _: None)

    def _start_router(self, spec: ProcessSpec) -> str:
        """Starts the router, on another free port while the one planned minutes ago was
        taken meanwhile (a free port is only free when asked); its URL."""
        for attempt in range(3):
            try:
                self._start([spec])
                return spec.url
            except PeerError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
                self.supervisor.groups.pop()
                port = spec.args[spec.args.index("--port") + 1]
                fresh = str(free_port())
                spec = replace(
                    spec,
                    args=tuple(fresh if a == port else a for a in spec.args),
                    url=spec.url.rsplit(":", 1)[0] + f":{fresh}",
                )
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.supervisor.stop()


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


async def complete(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Turn:
    """One greedy streamed completion; errors are recorded, never raised."""
    turn = Turn(prompt_tokens=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    start, stamps = time.perf_counter(), []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=_TIMEOUT) as response:
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return turn
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids or choice.get("text"):
                        stamps.append(time.perf_counter())
                        turn.tokens += ids
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                turn.cached_tokens = details.get("cached_tokens", turn.cached_tokens) or 0
    except httpx.HTTPError as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
        return turn
    if stamps:
        turn.ttft_s = stamps[0] - start
        turn.tbt_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return turn


async def run_workload(cfg: VllmBenchConfig, url: str) -> dict[tuple[int, int], Turn]:
    """The chat workload against `url`; the outcome of every (conversation, turn)."""
    results: dict[tuple[int, int], Turn] = {}

    async def conversation(
        index: int, parts: tuple[list[int], list[list[int]], list[list[int]]], client: httpx.AsyncClient
    ) -> None:
        await asyncio.sleep(index / cfg.rate)
        prefix, users, replies = parts
        history = list(prefix)
        for k in range(cfg.turns):
            history += users[k]
            results[(index, k)] = await complete(client, url, cfg.model, list(history), cfg.max_tokens)
            history += replies[k]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.gather(*(conversation(i, parts, client) for i, parts in enumerate(conversations(cfg))))
    return results


async def _warm(cfg: VllmBenchConfig, instances: list[str]) -> None:
    """Two 300-token requests straight to each instance, unrelated to the workload: full
    blocks, so that a connector's first lookup, save and pool connection (0.4 s for
    TsukimiConnector, measured) happen before measuring, as vLLM's own first-request costs do."""
    async with httpx.AsyncClient() as client:
        for i, url in enumerate(instances):
            for k in range(2):
                prompt = np.random.default_rng([cfg.seed, 1000 + i, k]).integers(*_VOCAB, 300).tolist()
                await complete(client, url, cfg.model, prompt, 2)


def summarize(
    system: str, turns: dict[tuple[int, int], Turn], reference: dict[tuple[int, int], Turn] | None
) -> dict[str, object]:
    """One row of the result (pure)."""
    ok = [t for t in turns.values() if not t.error]
    ttft = sorted(t.ttft_s for t in ok if t.ttft_s == t.ttft_s)
    tbt = [t.tbt_s for t in ok if t.tbt_s == t.tbt_s]
    prompt = sum(t.prompt_tokens for t in ok)
    equal = (
        None
        if reference is None
        else all(key in reference and not t.error and t.tokens == reference[key].tokens for key, t in turns.items())
    )
    row: dict[str, object] = {
        "system": system,
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
        "ttft_p90_s": round(ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 4) if ttft else None,
        "tbt_p50_ms": round(statistics.median(tbt) * 1e3, 2) if tbt else None,
        "cached_ratio": round(sum(t.cached_tokens for t in ok) / prompt, 4) if prompt else 0.0,
        "tokens_equal": equal if reference is not None else not (len(turns) - len(ok)),
    }
    first_error = next((t.error for t in turns.values() if t.error), "")
    if first_error:
        row["error"] = first_error
    return row


def run_bench(cfg: VllmBenchConfig, progress: Callable[[str], None]) -> dict[str, object]:
    """Every system in turn (see the module); the JSON-ready result."""
    runs: list[dict[str, object]] = []
    reference: dict[tuple[int, int], Turn] | None = None
    for system in cfg.systems:
        with tempfile.TemporaryDirectory(prefix=f"tsukimi-bench-vllm-{system}-") as workdir:
            try:
                progress(f"{system}: starting two vLLM instances and the router")
                cluster = BenchCluster(cluster_config(cfg, system), Path(workdir))
            except (ConfigError, PeerError, OSError) as exc:
                runs.append({"system": system, "error": f"{type(exc).__name__}: {exc}"})
                progress(f"{system}: could not start: {exc}")
                continue
            try:
                asyncio.run(_warm(cfg, cluster.instances))
                progress(f"{system}: chat workload against {cluster.api}")
                turns = asyncio.run(run_workload(cfg, cluster.api))
            finally:
                cluster.close()
        runs.append(summarize(system, turns, reference))
        reference = reference or (turns if system == cfg.systems[0] else None)
    return {"config": _plain(cfg), "revision": _git_rev(), "runs": runs, "ratios": ratios(runs)}


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


def markdown(result: dict[str, object]) -> str:
    """The result as the Markdown table docs/benchmarks.md holds (pure)."""
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


def _plain(cfg: VllmBenchConfig) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(cfg)


def _git_rev() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"
