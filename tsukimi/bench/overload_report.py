"""The figures and verdicts of `tsukimi bench serve --workload overload`, and the figures as a
rich table or Markdown (docs/reliability.md).

Verdicts (the report's), one per criterion of issue 17 item 3:
- health_under_100ms: every /health probe during the load and the drain answered 200 within 100 ms
  (the same probe on the idle cluster, before the load, is shown beside it);
- health_port_p99 / admission_p99 (issue 26 item 3): the router's health port's
  /health p99 (every probe answered 200) and the admission decisions' p99 (the router's door to
  its Conductor decision, from the decision log) are <= 100 ms;
- every_request_ended: no request failed (timeout, broken connection, 5xx or 429/503 without a
  reason, no tokens, a stream cut short) and each one sent has exactly one outcome;
- tokens_or_429_503: every request ended with tokens or a 429/503 naming a reason (no other error);
- rss_bounded: for each process, peak <= 2 x start + 256 MiB, and RSS rose by at most
  64 MiB + 10% over the second half of the load (not still climbing);
- post_load_ok: the requests after the load were all served with the baseline's text and tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rich.table import Table

from tsukimi.bench.client import CompletionResult
from tsukimi.bench.overload_monitor import Probe
from tsukimi.bench.report import FigureViews, Verdict
from tsukimi.quantiles import summary

MIB = 1 << 20
HEALTH_LIMIT_S = 0.1
_KINDS = ("served", "rejected", "error", "failed")


@dataclass(frozen=True, slots=True)
class LoadRun:
    """What one overload run measured (overload.py fills it in; `summarize` reads it).
    seconds: from the first arrival to the last arrival (sending) and to the last answer (wall);
    load_window: the load's start and end on the RSS samples' clock."""

    duration_s: float
    target_rps: float
    outcomes: list[CompletionResult]
    sending_s: float
    wall_s: float
    lag_s: float
    probes: list[Probe]
    load_window: tuple[float, float]
    cpu_percent: dict[str, float]
    sustainable_rps: float = 0.0
    calibration: list[dict[str, object]] = field(default_factory=list)
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    baseline: CompletionResult | None = None
    after: list[CompletionResult] = field(default_factory=list)
    idle_probes: list[Probe] = field(default_factory=list)
    port_probes: list[Probe] = field(default_factory=list)  # the router's health port (none: not probed)
    admission_s: list[float] = field(default_factory=list)  # each request's admission latency


def summarize(run: LoadRun) -> dict[str, object]:
    """The run's figures (pure; `verdicts` judges them; see the module)."""
    outcomes, duration_s, baseline, after = run.outcomes, run.duration_s, run.baseline, run.after
    assert baseline is not None
    kinds: Counter[str] = Counter(o.kind for o in outcomes)
    served = [o for o in outcomes if o.kind == "served"]
    memory = {name: _rss_figures(points, run.load_window) for name, points in run.rss.items()}
    post_ok = bool(after) and all(_same_answer(o, baseline) for o in after)
    health = _health(run.probes)
    figures: dict[str, object] = {
        "sustainable_rps": round(run.sustainable_rps, 3),
        "target_rps": round(run.target_rps, 3),
        "calibration": run.calibration,
        "sent": len(outcomes),
        "sending_s": round(run.sending_s, 3),
        "drain_s": round(run.wall_s - run.sending_s, 3),
        "generator_lag_s": round(run.lag_s, 3),
        "throughput_rps": round(kinds.get("served", 0) / run.wall_s, 3) if run.wall_s else 0.0,
        "offered_rps": round(len(outcomes) / duration_s, 3),
        **{kind: kinds.get(kind, 0) for kind in _KINDS},
        **{f"{kind}_rps": round(kinds.get(kind, 0) / duration_s, 3) for kind in _KINDS},
        "rejected_by": _by_reason(outcomes, "rejected"),
        "errors_by": _by_reason(outcomes, "error"),
        "failed_by": _by_reason(outcomes, "failed"),
        "examples": _examples(outcomes),
        "ttft_s": summary((o.ttft_s for o in served if o.stream), (0.5, 0.99), ndigits=4),
        "latency_s": summary((o.latency_s for o in served if not o.stream), (0.5, 0.99), ndigits=4),
        "health": health,
        "health_idle": _health(run.idle_probes),
        "health_port": _health(run.port_probes),
        "admission": _admission(run.admission_s, len(outcomes)),
        "rss_mib": memory,
        "cpu_percent": run.cpu_percent,
        "post_load": {
            "ok": post_ok,
            "baseline_tokens": baseline.completion_tokens,
            "answers": [
                f"{o.kind} {o.status} {o.reason} tokens={o.completion_tokens} same={_same_answer(o, baseline)}"
                for o in after
            ],
        },
    }
    return figures


def verdicts(figures: Mapping[str, object]) -> list[Verdict]:
    """One verdict per criterion (see the module) from `summarize`'s figures (pure)."""
    health, memory, post = figures["health"], figures["rss_mib"], figures["post_load"]
    assert isinstance(health, dict) and isinstance(memory, dict) and isinstance(post, dict)
    sent, failed, error = (int(str(figures[k])) for k in ("sent", "failed", "error"))
    ended = sum(int(str(figures[k])) for k in _KINDS)
    bounded = [name for name, m in memory.items() if not m["bounded"]]
    return [
        Verdict(
            "health_under_100ms",
            "every /health probe during the load answered 200 within 100 ms",
            bool(health["probes"]) and health["failed"] == 0 and health["over_100ms"] == 0,
            f"{health['over_100ms']} of {health['probes']} over 100 ms or failed; p99 {health['p99_ms']} ms",
        ),
        _p99_verdict("health_port_p99", "the health port's /health", figures.get("health_port")),
        _p99_verdict("admission_p99", "admission decisions", figures.get("admission")),
        Verdict(
            "every_request_ended",
            "no request failed, and each one sent has exactly one outcome",
            failed == 0 and ended == sent,
            f"{sent} sent, {ended} ended, {failed} failed",
        ),
        Verdict(
            "tokens_or_429_503",
            "every request ended with tokens or a 429/503 naming a reason",
            failed == 0 and error == 0,
            f"{error} errors, {failed} failures",
        ),
        Verdict(
            "rss_bounded",
            "each process: peak <= 2 x start + 256 MiB, late growth <= 64 MiB + 10%",
            (not bounded) if memory else None,
            f"unbounded: {', '.join(bounded)}" if bounded else ("all bounded" if memory else "RSS not sampled"),
        ),
        Verdict(
            "post_load_ok",
            "the requests after the load were served with the baseline's text and tokens",
            bool(post["ok"]),
            "; ".join(str(a) for a in post["answers"]),
        ),
    ]


def _p99_verdict(name: str, what: str, figures: object) -> Verdict:
    """p99 <= 100 ms and nothing failed, of a `_health` or `_admission` figure (None: not measured)."""
    f = figures if isinstance(figures, dict) else {}
    p99, count = f.get("p99_ms"), int(f.get("probes", f.get("count", 0)) or 0)
    ok = None if not count else f.get("failed", 0) == 0 and p99 is not None and p99 <= HEALTH_LIMIT_S * 1e3
    detail = f"p99 {p99} ms of {count}; {f.get('over_100ms')} over 100 ms" if count else "not measured"
    return Verdict(name, f"{what}: p99 <= 100 ms", ok, detail)


def _admission(latencies: Sequence[float], sent: int) -> dict[str, object]:
    """The admission latencies' figures: how many of the requests sent, p50 / p99 / max, over 100 ms."""
    q = summary(latencies, (0.5, 0.99), ndigits=4)
    return {
        "count": len(latencies),
        "of_sent": sent,
        "p50_ms": _ms(q["p50"]),
        "p99_ms": _ms(q["p99"]),
        "max_ms": round(max(latencies) * 1e3, 1) if latencies else None,
        "over_100ms": sum(s > HEALTH_LIMIT_S for s in latencies),
    }


def _same_answer(outcome: CompletionResult, baseline: CompletionResult) -> bool:
    return outcome.kind == "served" and (outcome.text, outcome.completion_tokens) == (
        baseline.text,
        baseline.completion_tokens,
    )


def _by_reason(outcomes: Sequence[CompletionResult], kind: str) -> dict[str, int]:
    """Counts by "<status> <reason>", for the outcomes of `kind`."""
    return dict(Counter(f"{o.status} {o.reason}" for o in outcomes if o.kind == kind).most_common())


def _examples(outcomes: Sequence[CompletionResult]) -> dict[str, str]:
    """The first message of each "<status> <reason>" that came with one (what the server said)."""
    examples: dict[str, str] = {}
    for o in outcomes:
        if o.message:
            examples.setdefault(f"{o.status} {o.reason}", o.message)
    return examples


def _health(probes: Sequence[Probe]) -> dict[str, object]:
    answered = [p.latency_s * 1e3 for p in probes if p.ok]
    q = summary((p.latency_s for p in probes if p.ok), (0.5, 0.99), ndigits=4)
    return {
        "probes": len(probes),
        "failed": sum(not p.ok for p in probes),
        "p50_ms": _ms(q["p50"]),
        "p99_ms": _ms(q["p99"]),
        "max_ms": round(max(answered), 1) if answered else None,
        "over_100ms": sum(not p.ok or p.latency_s > HEALTH_LIMIT_S for p in probes),
    }


def _rss_figures(points: list[tuple[float, int]], window: tuple[float, float]) -> dict[str, object]:
    """start / peak / end MiB of one process, and its growth over the load's second half."""
    start, peak, end = points[0][1], max(b for _, b in points), points[-1][1]
    mid_s = (window[0] + window[1]) / 2
    at_mid = max((b for t, b in points if t <= mid_s), default=start)
    at_end = max((b for t, b in points if t <= window[1]), default=start)
    late = at_end - at_mid
    bounded = peak <= 2 * start + 256 * MIB and late <= 64 * MIB + at_mid // 10
    return {
        "start": round(start / MIB, 1),
        "peak": round(peak / MIB, 1),
        "end": round(end / MIB, 1),
        "late_growth": round(late / MIB, 1),
        "bounded": bounded,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def rows(result: Mapping[str, object]) -> list[tuple[str, str]]:
    """(figure, value) rows: what the table and the Markdown show."""
    r = dict(result)
    ttft, lat, health, idle = r["ttft_s"], r["latency_s"], r["health"], r.get("health_idle") or {}
    assert isinstance(ttft, dict) and isinstance(lat, dict) and isinstance(health, dict) and isinstance(idle, dict)
    out = [
        ("sustainable rate (closed loop)", f"{r['sustainable_rps']} req/s"),
        ("offered (target)", f"{r['offered_rps']} req/s ({r['target_rps']}), {r['sent']} requests"),
        (
            "served / rejected / error / failed",
            f"{r['served_rps']} / {r['rejected_rps']} / {r['error_rps']} / {r['failed_rps']} req/s "
            f"({r['served']} / {r['rejected']} / {r['error']} / {r['failed']})",
        ),
        ("rejected by status and reason", _counts(r["rejected_by"])),
        ("errors / failures by reason", f"{_counts(r['errors_by'])} / {_counts(r['failed_by'])}"),
        ("what the server said (first of each)", _said(r.get("examples") or {})),
        ("TTFT p50 / p99 (served, streamed)", f"{_ms(ttft['p50'])} / {_ms(ttft['p99'])} ms"),
        ("latency p50 / p99 (served, whole)", f"{_ms(lat['p50'])} / {_ms(lat['p99'])} ms"),
        ("/health p50 / p99 / max", f"{health['p50_ms']} / {health['p99_ms']} / {health['max_ms']} ms"),
        (
            "/health idle p50 / p99 / max (before the load)",
            f"{idle.get('p50_ms')} / {idle.get('p99_ms')} / {idle.get('max_ms')} ms",
        ),
        ("/health probes over 100 ms or failed", f"{health['over_100ms']} of {health['probes']}"),
        ("health port /health p50 / p99 / max (off the loop)", _quantiles(r.get("health_port"))),
        ("admission decision p50 / p99 / max (door to Conductor)", _quantiles(r.get("admission"))),
        ("served throughput (load + drain)", f"{r['throughput_rps']} req/s; drain {r['drain_s']} s"),
        ("load generator lag (max)", f"{r['generator_lag_s']} s"),
    ]
    memory = r["rss_mib"]
    assert isinstance(memory, dict)
    for name, m in memory.items():
        out.append((f"RSS {name} start / peak / end", f"{m['start']} / {m['peak']} / {m['end']} MiB"))
    cpu = r.get("cpu_percent") or {}
    assert isinstance(cpu, dict)
    out.append(("CPU % of one core during the load", ", ".join(f"{k} {v}" for k, v in cpu.items()) or "n/a"))
    post = r["post_load"]
    assert isinstance(post, dict)
    out.append(("post-load check", "pass" if post["ok"] else f"FAIL: {post['answers']}"))
    return out


def _quantiles(figures: object) -> str:
    """ "p50 / p99 / max ms (over 100 ms of n)" of a `_health` / `_admission` figure ("-": none)."""
    f = figures if isinstance(figures, dict) else {}
    count = f.get("probes", f.get("count"))
    if not count:
        return "-"
    return f"{f['p50_ms']} / {f['p99_ms']} / {f['max_ms']} ms ({f['over_100ms']} of {count} over 100 ms)"


def _said(examples: object) -> str:
    assert isinstance(examples, dict)
    return "; ".join(f"{k}: {str(v)[:100]!r}" for k, v in examples.items()) or "-"


def _counts(value: object) -> str:
    assert isinstance(value, dict)
    return ", ".join(f"{k}: {n}" for k, n in value.items()) or "none"


def render_table(result: Mapping[str, object]) -> Table:
    table = Table(title="tsukimi bench serve --workload overload")
    table.add_column("figure")
    table.add_column("value")
    for name, value in rows(result):
        table.add_row(name, value)
    return table


def render_markdown(result: Mapping[str, object]) -> str:
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {n} | {v} |" for n, v in rows(result))])


VIEWS = FigureViews(render_markdown, render_table)
