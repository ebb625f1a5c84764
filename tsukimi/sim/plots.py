"""PNG plots of the experiments (matplotlib, headless Agg backend). Each function writes one
file and returns its path.

matplotlib is an optional dependency (the `plots` extra, tsukimi/extras.py): it is imported when
a plot is drawn, never with this module, so the simulator's tables run without it; drawing
without it raises ConfigError naming `pip install 'tsukimi[plots]'`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from tsukimi import extras

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from tsukimi.sim.cache_replay import CacheResult


def pyplot() -> ModuleType:
    """`matplotlib.pyplot` on the headless Agg backend (imports matplotlib on first use).

    Raises:
        ConfigError: matplotlib is not installed (the message names the `plots` extra).
    """
    matplotlib = extras.load("matplotlib", "plots", "drawing the simulator's plots")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def hit_ratio_vs_capacity(results: Sequence[CacheResult], path: Path) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    finite = sorted({r.capacity_blocks for r in results if r.capacity_blocks is not None})
    for policy in dict.fromkeys(r.policy for r in results):
        points = {r.capacity_blocks: r.token_hit_ratio for r in results if r.policy == policy}
        ax.plot(finite, [points[c] for c in finite], marker="o", label=policy)
        if None in points:
            ax.axhline(points[None], linestyle=":", color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("pool capacity (512-token blocks)")
    ax.set_ylabel("token hit ratio")
    ax.set_title("Hit ratio vs capacity (dotted: infinite cache)")
    ax.legend()
    return _save(fig, path)


def global_vs_local(rows: Sequence[dict[str, object]], path: Path) -> str:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for reuse in dict.fromkeys(str(r["reuse"]) for r in rows):
        mine = [r for r in rows if r["reuse"] == reuse]
        xs = [float(str(r["cache_blocks"])) for r in mine]
        left.plot(xs, [float(str(r["token_hit_ratio"])) for r in mine], marker="o", label=reuse)
        right.plot(xs, [float(str(r["prefill_s_mean"])) for r in mine], marker="o", label=reuse)
    left.set_ylabel("token hit ratio")
    right.set_ylabel("mean prefill time (s)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("cache per prefill instance (blocks)")
        ax.legend()
    fig.suptitle("Global pool vs per-instance caches (8P+8D)")
    return _save(fig, path)


def capacity(rows: Sequence[dict[str, object]], path: Path) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    slos = sorted({float(str(r["tbt_slo_s"])) for r in rows})
    width = 0.27
    systems = (
        ("mooncake", "Mooncake"),
        ("colocated_chunked", "colocated, chunked"),
        ("colocated_whole", "colocated, whole prompts"),
    )
    for n, (system, label) in enumerate(systems):
        offset = (n - 1) * width
        values = [
            float(str(r["requests_per_s"]))
            for s in slos
            for r in rows
            if r["system"] == system and float(str(r["tbt_slo_s"])) == s
        ]
        ax.bar([i + offset for i in range(len(slos))], values, width, label=label)
    ax.set_xticks(range(len(slos)), [f"{s * 1e3:.0f} ms" for s in slos])
    ax.set_xlabel("TBT SLO (TTFT SLO 30 s)")
    ax.set_ylabel("effective request capacity (req/s)")
    ax.legend()
    return _save(fig, path)


def decode_load(loads: dict[str, list[tuple[float, int]]], path: Path, title: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for mode, points in loads.items():
        ax.plot([t for t, _ in points], [n for _, n in points], label=mode, linewidth=1)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("requests in decode (all instances)")
    ax.set_title(f"Decode load ({title})")
    ax.legend()
    return _save(fig, path)


def _save(fig: Figure, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    pyplot().close(fig)
    return str(path)
