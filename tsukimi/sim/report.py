"""Figures from a simulation: latency percentiles, SLO attainment, cache reuse, rejections,
decode load over time; as a JSON-ready dict (stable key order, rounded floats, so equal runs
give byte-identical reports; null where there is no value) and as a rich table.

Definitions: percentiles are nearest-rank (tsukimi/quantiles.py). TTFT = first token - arrival.
TBT is per request, (last token - first token) / (output tokens - 1): the mean time per output
token after the first, which in the PD cluster includes the KV transfer to decode and any wait
for decode memory; its percentiles are over requests (not over individual token gaps, whose
tail under chunked prefill is much longer).

VRAM occupation (the paper's cost: KV size x the time it stays in GPU memory), in GB x s:
prefill holds a prompt's KV (input tokens) from the start of its prefill to its first token
(an upper bound: the whole prompt's KV for the whole prefill, as without layer-wise
streaming); decode holds what its instance reserved for the request, for as long as it was in
the batch. `per_request` is their sum over the prefilled requests, divided by their number.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from tsukimi.quantiles import quantile, summary
from tsukimi.sim.instances import Job
from tsukimi.sim.simulator import SimResult


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tbt_s: float


def summarize(result: SimResult, slo: Slo) -> dict[str, object]:
    """The report of one run (see the module)."""
    done = [j for j in result.jobs if j.finish_s >= 0 and j.request_id not in result.rejected]
    ttft = [j.first_token_s - j.arrival_s for j in done]
    tbt = [(j.finish_s - j.first_token_s) / (j.output_tokens - 1) for j in done if j.output_tokens > 1]
    prefilled = [j for j in result.jobs if j.first_token_s >= 0]
    input_tokens = sum(j.input_tokens for j in prefilled)
    good = sum(
        1
        for j in done
        if j.first_token_s - j.arrival_s <= slo.ttft_s
        and (j.output_tokens <= 1 or (j.finish_s - j.first_token_s) / (j.output_tokens - 1) <= slo.tbt_s)
    )
    span = max((j.arrival_s for j in result.jobs), default=0.0) or 1.0
    reasons = Counter(result.rejected.values())
    queued_met = sum(1 for j in done if j.request_id in result.queued and j.first_token_s - j.arrival_s <= slo.ttft_s)
    return {
        "requests": len(result.jobs),
        "completed": len(done),
        "rejected": len(result.rejected),
        "rejected_by_reason": {k: reasons[k] for k in sorted(reasons)},
        "queued": len(result.queued),
        "queued_met_ttft_slo": queued_met,
        "ttft_s": _summary(ttft),
        "tbt_s": _summary(tbt),
        "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s},
        "slo_attainment": _round(good / len(result.jobs)) if result.jobs else 0.0,
        "meets_slo_p90": bool(done)
        and quantile(ttft, 0.9) <= slo.ttft_s
        and (not tbt or quantile(tbt, 0.9) <= slo.tbt_s),
        "goodput_rps": _round(good / span),
        "token_hit_ratio": _round(sum(j.cached_tokens for j in prefilled) / input_tokens) if input_tokens else 0.0,
        "fetched_token_ratio": _round(sum(j.fetch_tokens for j in prefilled) / input_tokens) if input_tokens else 0.0,
        "prefill_s_mean": _round(sum(j.first_token_s - j.prefill_start_s for j in prefilled) / len(prefilled))
        if prefilled
        else 0.0,
        "wasted_prefills": reasons.get("decode_overloaded", 0),
        "ssd_token_ratio": _round(sum(j.ssd_tokens for j in prefilled) / input_tokens) if input_tokens else 0.0,
        "preemptions": result.preemptions,
        "vram_gb_s": _vram(result, prefilled),
        "end_s": _round(result.end_s),
    }


def _vram(result: SimResult, prefilled: Sequence[Job]) -> dict[str, float | None]:
    gb = result.kv_bytes_per_token / 1e9
    prefill = gb * sum(j.input_tokens * (j.first_token_s - j.prefill_start_s) for j in prefilled)
    decode = gb * sum(j.decode_token_s for j in result.jobs)
    per_request = (prefill + decode) / len(prefilled) if prefilled else 0.0
    return {"prefill": _round(prefill), "decode": _round(decode), "per_request": _round(per_request)}


def decode_load(result: SimResult, every_s: float) -> list[tuple[float, int]]:
    """Total decode batch over all instances every `every_s` (a multiple of the instances'
    sampling interval; an instance with no sample at a tick was idle); pure."""
    ticks = int(result.end_s // every_s) + 1
    total = [0] * ticks
    for samples in result.samples.values():
        for t, batch in samples:
            tick = t / every_s
            if abs(tick - round(tick)) < 1e-6 and round(tick) < ticks:
                total[round(tick)] += batch
    return [(tick * every_s, total[tick]) for tick in range(ticks)]


def load_swing(load: Sequence[tuple[float, int]], trend_s: float = 600.0) -> float:
    """How much a load series oscillates: the standard deviation of its deviation from its
    own moving average over `trend_s` (which removes the trace's slow drift), over its mean,
    leaving out the first and last tenth (warm-up and drain); 0 for a flat or empty series.
    Pure."""
    if len(load) < 3:
        return 0.0
    step = load[1][0] - load[0][0]
    half = max(1, int(trend_s / step / 2))
    values = [n for _, n in load]
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    cut = len(values) // 10
    window = range(cut, len(values) - cut)
    deviations = []
    for i in window:
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        deviations.append(values[i] - (prefix[hi] - prefix[lo]) / (hi - lo))
    mean = sum(values[i] for i in window) / len(window) if window else 0.0
    if not deviations or mean <= 0:
        return 0.0
    return _round(math.sqrt(sum(d * d for d in deviations) / len(deviations)) / mean) or 0.0


def table(title: str, rows: Sequence[tuple[str, dict[str, object]]]) -> str:
    """A rich table of several runs' main figures, rendered to text."""
    grid = Table(title=title)
    columns = ("run", "done", "rejected", "TTFT p50/p90 s", "TBT p50/p90 ms", "hit ratio", "SLO ok", "GB·s/req")
    for column in columns:
        grid.add_column(column, justify="right" if column != "run" else "left")
    for name, report in rows:
        ttft, tbt, vram = report["ttft_s"], report["tbt_s"], report["vram_gb_s"]
        assert isinstance(ttft, dict) and isinstance(tbt, dict) and isinstance(vram, dict)
        grid.add_row(
            name,
            str(report["completed"]),
            str(report["rejected"]),
            f"{ttft['p50']:.2f} / {ttft['p90']:.2f}",
            f"{1e3 * tbt['p50']:.0f} / {1e3 * tbt['p90']:.0f}",
            f"{report['token_hit_ratio']:.3f}",
            f"{report['slo_attainment']:.3f}",
            f"{vram['per_request']:.1f}",
        )
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(grid)
    return out.getvalue()


def _summary(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 (tsukimi/quantiles.py), rounded as every figure here (null: no value)."""
    return {key: None if value is None else _round(value) for key, value in summary(values).items()}


def _round(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None
