"""The raw copy rows of `tsukimi bench gpu`: what plain torch moves between host and GPU memory,
the limits tsukimi's device paths are measured against (issue 23).

    copy_rows(sizes, cuda, repeats)        raw.memcpy_gbps.<size>           host memcpy (always)
                                           raw.{h2d,d2h}_{pinned,pageable}_gbps.<size>  (CUDA only)
    kv_block_rows(blocks, bytes, cuda, r)  raw.kv_host_{per_block,batched}_gbps        (always)
                                           raw.kv_h2d_{per_block,batched}_gbps          (CUDA only)

"per_block" is one copy per KV block to its scattered place; "batched" is one contiguous copy
into staging plus one `index_copy_` (on the GPU for h2d). Without CUDA the GPU rows hold
NO_CUDA: a host figure is never reported under a GPU name. GB/s are 1e9 bytes per second,
medians of `repeats` timed runs after one warm-up run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tsukimi.bench.measure import Spread, repeat

NO_CUDA = "not measured: no CUDA"
Figure = float | str
_MOVED_PER_RUN = 256 << 20  # NOTE: small sizes repeat until a run moves this much (bounded below)


def size_label(num_bytes: int) -> str:
    """64 KiB -> "64KiB", 1 << 20 -> "1MiB", 1 << 30 -> "1GiB" (the figures' suffixes). Pure."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift and num_bytes % (1 << shift) == 0:
            return f"{num_bytes >> shift}{unit}"
    return f"{num_bytes}B"


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_s(device: torch.device, run: Callable[[], object], repeats: int) -> float:
    """Median seconds of `run` (synchronized before and after) over `repeats` runs, after one
    warm-up run."""

    def once(_: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        return time.perf_counter() - start

    return Spread.of(repeat(once, repeats=repeats, warmup_runs=1)).median


def copy_rows(sizes: tuple[int, ...], cuda: bool, repeats: int) -> dict[str, Figure]:
    """Host memcpy, and (with CUDA) host<->GPU copies pinned and pageable, at each size."""
    rows: dict[str, Figure] = {}
    host = torch.device("cpu")
    for size in sizes:
        label, count = size_label(size), max(2, min(200, _MOVED_PER_RUN // size))
        src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
        rows[f"raw.memcpy_gbps.{label}"] = _gbps(size * count, timed_s(host, _copies(dst, src, count), repeats))
        del src, dst
        names = [f"raw.{way}_{kind}_gbps.{label}" for kind in ("pinned", "pageable") for way in ("h2d", "d2h")]
        if not cuda:
            rows.update(dict.fromkeys(names, NO_CUDA))
            continue
        gpu = torch.zeros(size, dtype=torch.uint8, device="cuda")
        for kind in ("pinned", "pageable"):
            buffer = torch.ones(size, dtype=torch.uint8, pin_memory=kind == "pinned")
            for way, (to, of) in (("h2d", (gpu, buffer)), ("d2h", (buffer, gpu))):
                elapsed = timed_s(gpu.device, _copies(to, of, count), repeats)
                rows[f"raw.{way}_{kind}_gbps.{label}"] = _gbps(size * count, elapsed)
            del buffer
        del gpu
    return rows


def kv_block_rows(num_blocks: int, block_bytes: int, cuda: bool, repeats: int) -> dict[str, Figure]:
    """`num_blocks` blocks of `block_bytes` to scattered places of a cache twice that size: one
    copy per block vs one contiguous copy plus one `index_copy_`, host to host and (with CUDA)
    pinned host to GPU. Each way's result is checked against the source once.

    Raises:
        AssertionError: a way put a block in the wrong place (a bench bug, not a slow run).
    """
    rows: dict[str, Figure] = {}
    for where in ("host", "h2d"):
        names = (f"raw.kv_{where}_per_block_gbps", f"raw.kv_{where}_batched_gbps")
        if where == "h2d" and not cuda:
            rows.update(dict.fromkeys(names, NO_CUDA))
            continue
        device = torch.device("cuda" if where == "h2d" else "cpu")
        rows.update(zip(names, _kv_scatter_gbps(device, num_blocks, block_bytes, repeats), strict=True))
    return rows


def _kv_scatter_gbps(device: torch.device, num_blocks: int, block_bytes: int, repeats: int) -> tuple[float, float]:
    """(per-block GB/s, batched GB/s) of the blocks from host memory (pinned for a GPU) to `device`."""
    src = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8)
    src = src.pin_memory() if device.type == "cuda" else src
    cache = torch.zeros(2 * num_blocks, block_bytes, dtype=torch.uint8, device=device)
    places = torch.randperm(2 * num_blocks)[:num_blocks]
    places_on_device, staging = places.to(device), torch.empty_like(src, device=device)
    pairs = list(enumerate(places.tolist()))

    def per_block() -> None:
        for block, place in pairs:
            cache[place].copy_(src[block], non_blocking=True)

    def batched() -> None:
        staging.copy_(src, non_blocking=True)
        cache.index_copy_(0, places_on_device, staging)

    figures = []
    for run in (per_block, batched):
        cache.zero_()
        figures.append(_gbps(src.numel(), timed_s(device, run, repeats)))
        assert torch.equal(cache[places_on_device].cpu(), src), f"{run.__name__} to {device}: blocks misplaced"
    return figures[0], figures[1]


def _copies(to: torch.Tensor, of: torch.Tensor, count: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(count):
            to.copy_(of, non_blocking=True)

    return run


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("nan")
