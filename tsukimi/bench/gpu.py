"""`tsukimi bench gpu`: the raw rows of issue 23 (what plain torch does on this device) and the
places for tsukimi's own rows beside them, with the issue's goals as verdicts.

    raw copies       gpu_copies.py: host<->GPU pinned / pageable, host memcpy, 4,096 x 32 KiB
                     KV blocks per block vs one copy + one index_copy_
    raw model        gpu_model.py: prefill of `prompt_tokens` (Llama-3-8B shape, random bf16
                     weights, flash SDPA) and reuse = load the prefix KV from pinned host memory
                     (one copy per layer and K/V) + compute `new_tokens`
    tsukimi rows     the Transfer Engine between two processes (host<->GPU, GPU<->GPU), the
                     store filling a paged GPU cache, the engine in process and through
                     `tsukimi up` clusters (gpu_store.py, gpu_engine.py)

Figures are one flat dict named so ratios read off directly: `raw.h2d_pinned_gbps.1MiB`,
`raw.prefill_s.16k`, `raw.reuse_vs_prefill.16k`, `tsukimi.te_h2d_gbps.1MiB`. A row group that
fails (or the time limit) leaves `errors.GROUP` and the other groups' figures. Without
CUDA the command still runs (CI): GPU rows hold "not measured: no CUDA", the model is the tiny
shape in float32, and every verdict says not measured. A GPU figure is never claimed on a CPU.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tsukimi.bench.gpu_copies import NO_CUDA, Figure, copy_rows, kv_block_rows, size_label, synchronize, timed_s
from tsukimi.bench.gpu_engine import engine_rows, process_rows
from tsukimi.bench.gpu_model import SHAPES, LayerKV, RawDecoder
from tsukimi.bench.gpu_store import store_rows
from tsukimi.bench.report import BenchReport, FigureViews, Verdict, begin, finish, goal
from tsukimi.errors import ConfigError
from tsukimi.transfer.device_bench import measure_device_transfers

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True, slots=True)
class GpuBenchConfig:
    """What one run measures. `device` is "cuda" or "cpu" (`for_device` picks the sizes)."""

    device: str
    shape: str
    copy_bytes: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    new_tokens: int
    num_kv_blocks: int = 4096
    kv_block_bytes: int = 32 * KIB
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ConfigError(f"unknown model shape {self.shape!r} (choose from {', '.join(SHAPES)})")
        if self.device not in ("cuda", "cpu") or self.repeats < 1:
            raise ConfigError(f"device must be cuda or cpu and repeats >= 1 (got {self.device!r}, {self.repeats})")

    @classmethod
    def for_device(cls, cuda: bool, quick: bool, shape: str = "", repeats: int = 3) -> GpuBenchConfig:
        """The issue's sizes on a GPU (quick: no 1 GiB copy, prompts 4k and 16k); on a CPU the
        tiny shape at prompts small enough for CI (quick: 128 and 512 tokens, ~10 s). Pure."""
        copies = (64 * KIB, MIB, 64 * MIB) if quick else (64 * KIB, MIB, 64 * MIB, GIB)
        if cuda:
            prompts = (4096, 16384) if quick else (4096, 16384, 32768)
            return cls("cuda", shape or "llama3-8b", copies, prompts, 512, repeats=repeats)
        prompts = (128, 512) if quick else (256, 1024, 4096)
        return cls("cpu", shape or "tiny", copies, prompts, 32, repeats=repeats)


def token_label(num_tokens: int) -> str:
    """4096 -> "4k", 16384 -> "16k", 300 -> "300" (the model figures' suffixes). Pure."""
    return f"{num_tokens // 1024}k" if num_tokens % 1024 == 0 else str(num_tokens)


def model_rows(cfg: GpuBenchConfig, say: Callable[[str], None]) -> dict[str, Figure]:
    """Prefill and reuse of the raw model at each prompt length (see the module)."""
    cuda = cfg.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SHAPES[cfg.shape]
    model = RawDecoder(shape, cfg.device, dtype)
    rows: dict[str, Figure] = {"raw.model_shape": shape.name, "raw.model_dtype": str(dtype).removeprefix("torch.")}
    rows["raw.kv_bytes_per_token"] = float(shape.kv_bytes_per_token(dtype))
    for num_tokens in cfg.prompt_tokens:
        rows |= _prompt_rows(model, cfg, num_tokens, say)
        gc.collect()
    del model
    if cuda:
        torch.cuda.empty_cache()
    return rows


def _prompt_rows(
    model: RawDecoder, cfg: GpuBenchConfig, num_tokens: int, say: Callable[[str], None]
) -> dict[str, Figure]:
    """Prefill of `num_tokens`, the load of their KV from host memory, and reuse (load + new tokens)."""
    device, shape, label = model.embed.device, model.shape, token_label(num_tokens)
    dtype = model.embed.dtype
    prompt = torch.randint(0, shape.vocab, (num_tokens,), device=device)
    new = torch.randint(0, shape.vocab, (cfg.new_tokens,), device=device)
    prefix = _host_prefix(shape.num_layers, num_tokens, shape.num_kv_heads, shape.head_dim, dtype, device)

    def load() -> list[LayerKV]:
        return [(k.to(device, non_blocking=True), v.to(device, non_blocking=True)) for k, v in prefix]

    prefill = timed_s(device, lambda: model(prompt), cfg.repeats)
    load_s = timed_s(device, load, cfg.repeats)
    reuse = timed_s(device, lambda: model(new, past=load()), cfg.repeats)
    say(f"{shape.name} {label}: prefill {prefill:.3f} s, reuse {reuse:.3f} s (load {load_s:.3f} s)")
    return {
        f"raw.prefill_s.{label}": prefill,
        f"raw.prefill_tokens_per_s.{label}": num_tokens / prefill,
        f"raw.reuse_s.{label}": reuse,
        f"raw.prefix_load_s.{label}": load_s,
        f"raw.prefix_load_gbps.{label}": num_tokens * shape.kv_bytes_per_token(dtype) / load_s / 1e9,
        f"raw.reuse_vs_prefill.{label}": reuse / prefill,
    }


def _host_prefix(
    layers: int, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> list[LayerKV]:
    """Random K and V per layer in host memory, pinned when `device` is a GPU (filled there:
    normal_ over gigabytes on the host would take longer than the bench)."""
    pin = device.type == "cuda"

    def one() -> torch.Tensor:
        host = torch.empty(tokens, kv_heads, head_dim, dtype=dtype, pin_memory=pin)
        return host.copy_(torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device))

    prefix = [(one(), one()) for _ in range(layers)]
    synchronize(device)
    return prefix


# --- tsukimi's rows (issue 23) ------------------------------------------------------------------
# NOTE: the places the parts of issue 23 fill in; each returns {} until its part exists, and the
# verdicts below read whatever keys they return. Keep the names: `tsukimi.<what>.<size or tokens>`.


def tsukimi_te_rows(cfg: GpuBenchConfig) -> dict[str, Figure]:
    """The Transfer Engine between two processes on this host with device memory
    (tsukimi/transfer/device_bench.py; the emulated device without CUDA), `auto` and `tcp`:
    `tsukimi.te.{transport}.{op}.{local}_to_{remote}.{size}` GB/s, and the verdicts' keys
    `tsukimi.te_h2d_gbps.{size}` / `tsukimi.te_d2h_gbps.{size}` (auto: host memory here, the
    peer's GPU) and `tsukimi.te_d2d_gbps.{size}` (auto: GPU to GPU, CUDA IPC)."""
    cuda = cfg.device == "cuda"
    sizes = [n for n in cfg.copy_bytes if n <= 64 * MIB] if cuda else [64 * KIB, MIB]
    results = measure_device_transfers("cuda" if cuda else "emu", ("auto", "tcp"), sizes, 0.5 if cuda else 0.05)
    figures: dict[str, Figure] = {}
    for r in results:
        size = size_label(r.size_bytes)
        figures[f"tsukimi.te.{r.transport}.{r.op}.{r.local}_to_{r.remote}.{size}"] = round(r.gbps, 3)
        if r.transport != "auto":
            continue
        figures[f"tsukimi.te.auto_carried_by.{r.local}_to_{r.remote}"] = r.carried_by
        if (r.local, r.remote) == ("host", "device"):
            figures[f"tsukimi.te_{'h2d' if r.op == 'WRITE' else 'd2h'}_gbps.{size}"] = round(r.gbps, 3)
        elif (r.local, r.remote) == ("device", "device") and r.op == "WRITE":
            figures[f"tsukimi.te_d2d_gbps.{size}"] = round(r.gbps, 3)
    return figures


def tsukimi_store_rows(cfg: GpuBenchConfig) -> dict[str, Figure]:
    """The store filling a paged cache of `cfg.num_kv_blocks` x `cfg.kv_block_bytes` blocks from
    a holder process (tsukimi/bench/gpu_store.py): `tsukimi.store_kv_blocks_gbps`. Without CUDA
    256 blocks into a CPU cache (the host path: a check that the row runs, not a GPU figure)."""
    cuda = cfg.device == "cuda"
    blocks = cfg.num_kv_blocks if cuda else 256
    return store_rows("cuda" if cuda else "cpu", blocks, cfg.kv_block_bytes, cfg.repeats)


def tsukimi_engine_rows(cfg: GpuBenchConfig, say: Callable[[str], None] = print) -> dict[str, Figure]:
    """The engine in one process (prefill, reuse of a prefix from pinned host rows) at each
    prompt length (tsukimi/bench/gpu_engine.py): `tsukimi.engine_prefill_s.16k`,
    `tsukimi.engine_reuse_s.16k`, ..."""
    say("tsukimi engine, in process")
    return engine_rows(cfg.shape, cfg.device, cfg.prompt_tokens, cfg.new_tokens, token_label)


def tsukimi_process_rows(cfg: GpuBenchConfig, say: Callable[[str], None] = print) -> dict[str, Figure]:
    """TTFT through real processes at the longest prompt: colocated, PD, PD with a shared
    prefix (tsukimi/bench/gpu_engine.py): `tsukimi.pd_ttft_vs_colocated.16k`, ..."""
    longest = cfg.prompt_tokens[-1]
    say("tsukimi engine, through processes")
    return process_rows(cfg.shape, cfg.device, longest, cfg.new_tokens, cfg.repeats, token_label(longest), say)


def verdicts(figures: Mapping[str, Figure], cuda: bool) -> list[Verdict]:
    """The issue's goals on this run's figures (ratios to the same run's raw rows). Pure."""
    te = [
        _ratio(figures, f"tsukimi.te_h2d_gbps.{label}", f"raw.h2d_pinned_gbps.{label}")
        for label in (size_label(n) for n in (MIB, 64 * MIB))
    ]
    checks = [
        ("te_h2d_vs_pinned", "TE host->GPU / raw pinned copy, from 1 MiB (min)", _least(te), ">=", 0.8),
        (
            "store_kv_blocks_gbps",
            "store: 4,096 x 32 KiB into a paged GPU cache, GB/s",
            _get(figures, "tsukimi.store_kv_blocks_gbps"),
            ">=",
            30.0,
        ),
        (
            "engine_prefill_vs_raw_16k",
            "engine prefill tokens/s / raw at 16k",
            _ratio(figures, "raw.prefill_s.16k", "tsukimi.engine_prefill_s.16k"),
            ">=",
            0.7,
        ),
        (
            "engine_reuse_vs_recompute_16k",
            "engine TTFT, 16k pooled prefix / recompute",
            _ratio(figures, "tsukimi.engine_reuse_s.16k", "tsukimi.engine_prefill_s.16k"),
            "<=",
            0.2,
        ),
        (
            "pd_ttft_vs_colocated_16k",
            "PD TTFT / colocated TTFT at 16k",
            _get(figures, "tsukimi.pd_ttft_vs_colocated.16k"),
            "<=",
            1.2,
        ),
    ]
    out = []
    for name, what, value, op, target in checks:
        verdict = goal(name, what, value, op, target)  # type: ignore[arg-type]
        out.append(verdict if cuda else Verdict(name, verdict.goal, None, NO_CUDA))
    return out


def _get(figures: Mapping[str, Figure], key: str) -> float | None:
    value = figures.get(key)
    return value if isinstance(value, float) else None


def _ratio(figures: Mapping[str, Figure], top: str, bottom: str) -> float | None:
    a, b = _get(figures, top), _get(figures, bottom)
    return a / b if a is not None and b else None


def _least(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known and len(known) == len(values) else None


def run_report(cfg: GpuBenchConfig, say: Callable[[str], None] = print) -> BenchReport:
    """`tsukimi bench gpu`: the raw rows, tsukimi's rows (empty until built), the verdicts.

    Raises:
        ConfigError: cfg asks for CUDA and torch sees none.
    """
    cuda = cfg.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ConfigError("device cuda: torch sees no CUDA device")
    start = begin("bench gpu", cfg)
    figures: dict[str, Figure] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    groups: list[tuple[str, Callable[[], dict[str, Figure]]]] = [
        ("copies", lambda: copy_rows(cfg.copy_bytes, cuda, cfg.repeats)),
        ("kv_blocks", lambda: kv_block_rows(cfg.num_kv_blocks, cfg.kv_block_bytes, cuda, cfg.repeats)),
        ("raw_model", lambda: model_rows(cfg, say)),
        ("transfer_engine", lambda: tsukimi_te_rows(cfg)),
        ("store", lambda: tsukimi_store_rows(cfg)),
        ("engine", lambda: tsukimi_engine_rows(cfg, say)),
        ("processes", lambda: tsukimi_process_rows(cfg, say)),
    ]
    for name, rows in groups:
        # NOTE: one failing group (or the script's SIGINT at its time limit) must not lose the
        # figures of the others: the GPU machine is lent for minutes; the error is a figure too
        say(name)
        try:
            figures |= rows()
        except KeyboardInterrupt:
            figures[f"errors.{name}"] = "interrupted (time limit): later groups not run"
            break
        except Exception as exc:  # NOTE: any failure of a group is reported, whatever it is
            figures[f"errors.{name}"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return finish(start, figures, verdicts(figures, cuda))


def markdown(figures: Mapping[str, object]) -> str:
    """The figures as docs/benchmarks.md holds them: copies by size, KV blocks, the model (pure)."""
    sizes = [key.rsplit(".", 1)[1] for key in figures if key.startswith("raw.memcpy_gbps.")]
    kinds = ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable", "memcpy")
    lines = [f"device {figures.get('device')}.", "", "| size | " + " | ".join(kinds) + " |", "|---" * 6 + "|"]
    lines += [f"| {s} | " + " | ".join(_cell(figures.get(f"raw.{k}_gbps.{s}")) for k in kinds) + " |" for s in sizes]
    lines += ["", "| 4,096 x 32 KiB KV blocks, GB/s | per block | one copy + index_copy_ |", "|---|---|---|"]
    for where in ("h2d", "host"):
        per, batched = (figures.get(f"raw.kv_{where}_{way}_gbps") for way in ("per_block", "batched"))
        lines.append(f"| {where} | {_cell(per)} | {_cell(batched)} |")
    shape = figures.get("raw.model_shape")
    lines += ["", f"| {shape} | prefill s | tokens/s | reuse s | prefix load s | reuse / prefill |", "|---" * 6 + "|"]
    for key in (k for k in figures if k.startswith("raw.prefill_s.")):
        t = key.rsplit(".", 1)[1]
        cells = ("prefill_s", "prefill_tokens_per_s", "reuse_s", "prefix_load_s", "reuse_vs_prefill")
        lines.append(f"| {t} | " + " | ".join(_cell(figures.get(f"raw.{c}.{t}")) for c in cells) + " |")
    ours = {k: v for k, v in figures.items() if k.startswith(("tsukimi.", "errors."))}
    lines += ["", "| tsukimi | value |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in ours.items()]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "n/a" if value in (None, NO_CUDA) else str(value)


VIEWS = FigureViews(markdown)
