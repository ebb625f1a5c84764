"""`tsukimi top`: the router's dashboard in the terminal.

    tsukimi top                                  # http://127.0.0.1:8000, redrawn every second
    tsukimi top --url http://HOST:PORT --once    # one frame, printed (scripts, tests)

Polls the router's GET /dashboard/api/snapshot (tsukimi/serving/dashboard/app.py) and draws the
same view as the page with rich: workers by role, the KV pool's segments, totals and the hit
ratio, TTFT / TBT percentiles with a sparkline of recent throughput, rejections, and the newest
placement decisions. A router that does not answer is shown as such and asked again.
"""

from __future__ import annotations

import argparse
import logging

import httpx
import msgspec
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tsukimi.clock import WallClock
from tsukimi.errors import PeerError
from tsukimi.serving.dashboard.snapshot import Snapshot

logger = logging.getLogger(__name__)

SNAPSHOT_PATH = "/dashboard/api/snapshot"
_BARS = "▁▂▃▄▅▆▇█"
_SPARK_POINTS = 60


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers `tsukimi top` on the CLI's subparsers (mutates `sub`)."""
    p = sub.add_parser("top", help="the router's live dashboard in the terminal")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    p.add_argument("--once", action="store_true", help="print one frame and exit")


def fetch(client: httpx.Client, url: str) -> Snapshot:
    """The router's snapshot.

    Raises:
        PeerError: the router cannot be reached, answers an error status or garbage.
    """
    try:
        response = client.get(url.rstrip("/") + SNAPSHOT_PATH)
        response.raise_for_status()
        return msgspec.json.decode(response.content, type=Snapshot)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        raise PeerError(f"no snapshot from the router at {url}: {exc}") from exc


def run(args: argparse.Namespace, console: Console) -> None:
    """Prints one frame (`--once`) or redraws until Ctrl-C. Raises PeerError (once only)."""
    with httpx.Client(timeout=max(2.0, args.interval)) as client:
        if args.once:
            console.print(render(fetch(client, args.url)))
            return
        clock = WallClock()
        with Live(Text(f"connecting to {args.url} ..."), console=console, screen=False, auto_refresh=False) as live:
            while True:
                try:
                    frame: Group | Text = render(fetch(client, args.url))
                except PeerError as exc:
                    frame = Text(str(exc), style="red")
                live.update(frame, refresh=True)
                clock.sleep(args.interval)


def render(s: Snapshot) -> Group:
    """One frame of the view (pure)."""
    t = s.totals
    head = Text.assemble(
        (f"tsukimi router ({s.mode}) {s.model}", "bold"),
        f"   requests {t.requests_ok} ok / {t.requests_failed} failed   tokens {t.prompt_tokens} in / "
        f"{t.completion_tokens} out   cached {t.hit_ratio:.1%}  from pool {t.pool_ratio:.1%}",
    )
    return Group(head, _workers(s), _store(s), _latency(s), _decisions(s))


def _workers(s: Snapshot) -> Table:
    table = Table(
        "worker",
        "role",
        "up",
        "waiting",
        "running",
        "in flight",
        "sent",
        "KV used",
        "KV free",
        title="workers",
        title_justify="left",
        expand=False,
    )
    for w in sorted(s.workers, key=lambda w: (w.role, w.name)):
        up = "yes" if w.healthy else "[red]DOWN[/red]"
        table.add_row(
            w.name,
            w.role,
            up,
            str(w.waiting),
            str(w.running),
            str(w.in_flight),
            str(w.requests),
            f"{w.used_blocks}/{w.total_blocks}",
            str(w.free_blocks),
        )
    return table


def _store(s: Snapshot) -> Table | Text:
    store = s.store
    if not store.master:
        return Text("KV pool: no master given (colocated, or the router was started without --master)", style="dim")
    stats = "  ".join(f"{k} {v:g}" for k, v in store.stats.items())
    table = Table(
        "segment",
        "client",
        "used",
        "capacity",
        "use",
        "up",
        expand=False,
        title_justify="left",
        title=f"KV pool at {store.master}   {stats}",
        caption=store.error or None,
    )
    for seg in store.segments:
        use = seg.used_bytes / seg.capacity_bytes if seg.capacity_bytes else 0.0
        table.add_row(
            seg.segment_id,
            seg.client_id,
            _size(seg.used_bytes),
            _size(seg.capacity_bytes),
            f"{use:.1%}",
            "yes" if seg.healthy else "[red]no[/red]",
        )
    return table


def _latency(s: Snapshot) -> Table:
    lat = s.latency
    table = Table(
        "",
        "p50",
        "p90",
        "p99",
        f"last {lat.window_s:g} s ({lat.samples} requests)",
        expand=False,
        title="latency",
        title_justify="left",
    )
    recent = s.series[-_SPARK_POINTS:]
    table.add_row("TTFT", *(_ms(x) for x in lat.ttft_s), _spark([p.ttft_p90_s or 0.0 for p in recent]) + " p90")
    table.add_row("TBT", *(_ms(x) for x in lat.tbt_s), _spark([p.tokens_per_s for p in recent]) + " tokens/s")
    rejected = ", ".join(f"{reason} {n}" for reason, n in sorted(s.rejections.items())) or "none"
    table.add_row("rejected", rejected, "", "", "")
    return table


def _decisions(s: Snapshot) -> Table:
    title = f"decisions ({s.decisions_total} in all, newest first)"
    table = Table(
        "#",
        "request",
        "prompt",
        "prefill / worker",
        "decode",
        "exp. cached",
        "cached",
        "pred. TTFT",
        "outcome",
        expand=False,
        title=title,
        title_justify="left",
    )
    for d in s.decisions[:10]:
        outcome = "accepted" if d.accepted else f"[red]rejected: {d.reason}[/red]"
        table.add_row(
            str(d.seq),
            d.request_id[-12:],
            str(d.prompt_tokens),
            d.prefill or "-",
            d.decode or "-",
            "-" if d.expected_cached_tokens is None else str(d.expected_cached_tokens),
            "-" if d.cached_tokens is None else str(d.cached_tokens),
            _ms(d.predicted_ttft_s),
            outcome,
        )
    return table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def _spark(values: list[float]) -> str:
    """A one-line chart of `values` scaled to their maximum (pure)."""
    top = max(values, default=0.0)
    if top <= 0:
        return _BARS[0] * len(values)
    return "".join(_BARS[min(len(_BARS) - 1, int(v / top * (len(_BARS) - 1) + 0.5))] for v in values)
