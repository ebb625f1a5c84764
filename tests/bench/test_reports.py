"""Every `tsukimi bench ...` command, run with its smallest configuration and `--json`, prints
the one report type (tsukimi/bench/report.py): the output parses as `BenchReport`, names its
command, configuration, revision and host, and carries the bench's figures in their documented
shape and its verdicts, `quiet_machine` among them. Speed is never asserted.

Smallest configurations: transfer and store `--quick` on fewer cells; p2p an 8 MiB checkpoint
in 1 MiB shards to N = 1, 2 (far below `--quick`'s 256 MiB); p2p `--lab --quick` (3 receivers
on emulated hosts, 8 MiB, 100 Mbit/s links), transfer `--lab --quick` (two hosts of two
200 Mbit/s NICs, 16 MiB batches, one NIC cut mid-run) and hot-lab `--quick` (3 holders, 4
readers, 30 requests, off then on) (the lab ones skipped, saying why, where namespaces are
refused: CI has them); scheduler the sample trace with 200
decisions; cpp a 300-token prompt, one repeat; prefix-link `--quick` (the tiny model, a 2048-token
pooled prefix across a 20 and a 400 Mbit/s lab link; skipped where namespaces are refused);
layerwise a 64-token prefix; serve `--quick` (chat
4 x 2) without the no-reuse run; overload `--quick`; kv-burst 4 prompts of 200 tokens;
gpu `--quick --repeats 1` (without CUDA: host memcpy and the tiny model, GPU rows not measured);
sglang `--quick --systems tsukimi` (128 pages at TP 1; skipped, saying why, without .venv-sglang).

vllm and vllm-pd: here only their flags (what `--quick` picks reaches the bench, the report is
printed); their reports are measured on the vLLM servers the integration tests run anyway
(tests/integrations/test_vllm_e2e.py, tests/integrations/vllm/test_vllm_pd.py: a vLLM server
takes a minute to start on two CPUs).
"""

from __future__ import annotations

import argparse
import io
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from rich.console import Console

from tests.bench.report_checks import check_report
from tests.bench.report_checks import verdict_names as _verdicts
from tsukimi.bench.commands import add_parser
from tsukimi.bench.report import QUIET_MACHINE, BenchReport, begin, finish
from tsukimi.bench.runners import overload_config, serve_config
from tsukimi.bench.vllm import VllmBenchConfig
from tsukimi.bench.vllm_pd import QUICK as VLLM_PD_QUICK
from tsukimi.errors import ConfigError
from tsukimi.integrations.sglang.paths import check_venv
from tsukimi.lab.netns import require_namespaces

MIB = 1 << 20


def _sglang_missing() -> str:
    try:
        check_venv()
    except ConfigError as exc:
        return str(exc)
    return ""


SGLANG_MISSING = _sglang_missing()


def _namespaces_refused() -> str:
    try:
        require_namespaces()
    except ConfigError as exc:
        return str(exc)
    return ""


NAMESPACES_REFUSED = _namespaces_refused()


@dataclass(frozen=True)
class Case:
    """One command line after `tsukimi bench`, what its report must hold, and its time bound."""

    args: tuple[str, ...]
    check: Callable[[BenchReport], None]
    timeout_s: int = 150


def _transfer(report: BenchReport) -> None:
    figures = report.figures
    assert set(figures) >= {"results", "peers", "baselines", "mooncake", "ratios", "unit"}
    assert figures["mooncake"] is None
    rows = figures["results"]
    assert isinstance(rows, list)
    assert {(r["transport"], r["op"], r["block_bytes"]) for r in rows} == {
        (t, "write", b) for t in ("auto", "tcp") for b in (64 << 10, 4 * MIB)
    }
    for row in rows:
        assert set(row) == {"transport", "op", "block_bytes", "batch", "connections", "gbps"} and row["gbps"] > 0
    baselines = figures["baselines"]
    assert isinstance(baselines, dict) and baselines["socket_gbps"] > 0 and baselines["memcpy_gbps"] > 0
    assert _verdicts(report) >= {
        "auto_64k_vs_nixl",
        "auto_1_16mib_vs_memcpy",
        "tcp_64k_vs_mooncake",
        "tcp_4mib_vs_socket",
    }
    assert report.verdict("auto_64k_vs_nixl").met is None  # type: ignore[union-attr]  # NIXL not compared


def _store(report: BenchReport) -> None:
    figures = report.figures
    assert set(figures) >= {"results", "small_ops", "disk_errors"}
    rows = figures["results"]
    assert isinstance(rows, list)
    for row in rows:
        puts = {"put_gbps", "put_p50_us"} if row["tier"] == "memory" else {"stayed_on_disk"}
        assert {"system", "mode", "api", "value_bytes", "replicas", "tier", "get_gbps", "get_p50_us"} | puts <= set(row)
        assert row["system"] == "tsukimi" and row["mode"] == "shm" and row["get_gbps"] > 0
    assert sorted(r["tier"] for r in rows) == ["disk", "disk", "memory", "memory"]
    assert all(r["stayed_on_disk"] == 1.0 for r in rows if r["tier"] == "disk")
    assert {r["value_bytes"] for r in rows} == {64 << 10, MIB}
    assert figures["small_ops"]["tsukimi"]["exists_p50_us"] > 0  # type: ignore[index]
    assert report.verdict("1mib_vs_mooncake").met is None  # type: ignore[union-attr]  # Mooncake not compared


def _p2p(report: BenchReport) -> None:
    runs = report.figures["runs"]
    assert isinstance(runs, list)
    assert [(r["system"], r["receivers"]) for r in runs] == [
        (system, n) for n in (1, 2) for system in ("tsukimi", "naive", "gloo")
    ]
    ckpt = 8 * MIB
    for row in runs:
        assert {"system", "receivers", "checkpoint_bytes", "seconds", "gbps", "origin_bytes"} <= set(row)
        assert row["checkpoint_bytes"] == ckpt and row["seconds"] > 0 and row["verified"] is True
        assert row["gbps"] == pytest.approx(row["receivers"] * ckpt / row["seconds"] / 1e9, rel=1e-2)
        if row["system"] == "naive":
            assert row["origin_bytes"] == row["receivers"] * ckpt and row["replica_bytes"] == 0
        elif row["system"] == "tsukimi":
            assert row["origin_bytes"] + row["replica_bytes"] == row["receivers"] * ckpt
            assert row["origin_bytes"] >= ckpt  # NOTE: every shard leaves the origin at least once
        else:  # gloo: what rank 0 wrote, at least one copy of the checkpoint
            assert row["origin_bytes"] >= ckpt
        assert row["transport"] == "tcp"
    assert _verdicts(report) == {"origin_x_checkpoint_tcp", "seconds_x_naive_tcp", "gbps_x_gloo_tcp", QUIET_MACHINE}


def _transfer_lab(report: BenchReport) -> None:
    figures = report.figures
    assert report.configuration["nic_rate"] == "200mbit"
    hosts = figures["topology"]["hosts"]  # type: ignore[index]
    assert [(h["name"], len(h["addresses"])) for h in hosts] == [("a", 2), ("b", 2), ("meta", 1)]
    cells = figures["cells"]
    assert isinstance(cells, list)
    assert [(c["nics"], c["op"], c["shaped"]) for c in cells] == [
        (n, op, shaped) for n, shaped in ((1, True), (2, True), (2, False)) for op in ("write", "read")
    ]
    for cell in cells:
        assert cell["seconds"] > 0 and cell["errors"] == [], cell
        used = [nic for nic, moved in cell["nic_bytes"].items() if moved >= cell["batch_bytes"] // 4]
        assert used == (["eth0"] if cell["nics"] == 1 else ["eth0", "eth1"]), cell  # NOTE: 1 NIC: eth0 only
    failure = figures["nic_failure"]
    assert isinstance(failure, dict) and len(failure["batches"]) == 4 and failure["time_lost_s"] >= 0
    assert _verdicts(report) == {
        "two_nics_x_one",
        "failed_batches_nic_down",
        "one_nic_link_busy",
        "unshaped_x_shaped",
        QUIET_MACHINE,
    }


def _p2p_lab(report: BenchReport) -> None:
    figures, ckpt = report.figures, 8 * MIB
    assert report.configuration["link_rate"] == "100mbit" and report.configuration["receivers"] == 3
    hosts = figures["topology"]["hosts"]  # type: ignore[index]
    assert [h["name"] for h in hosts] == ["meta", "origin", "r1", "r2", "r3"]
    assert len({h["address"] for h in hosts}) == 5
    runs = figures["runs"]
    assert isinstance(runs, list)
    assert [(r["system"], r["receivers"]) for r in runs] == [("one_link", 1), ("tsukimi", 3), ("naive", 3), ("gloo", 3)]
    for row in runs:
        assert row["checkpoint_bytes"] == ckpt and row["seconds"] > 0 and row["verified"] is True, row
        assert row["transport"] == "tcp" and set(row["link_bytes"]) == {h["name"] for h in hosts}
        assert row["origin_link_bytes"] >= row["origin_bytes"] > 0  # NOTE: the wire adds headers
        assert 0 < row["origin_link_busy"] <= 1.2 and 0 < row["receiver_link_busy"] <= 1.2, row
    tsukimi = runs[1]
    assert tsukimi["origin_bytes"] + tsukimi["replica_bytes"] == 3 * ckpt and tsukimi["origin_bytes"] >= ckpt
    assert {"mean_read_s", "mean_announce_s", "mean_idle_s"} <= set(tsukimi)
    assert runs[2]["origin_bytes"] == 3 * ckpt
    assert _verdicts(report) == {
        "seconds_x_naive",
        "seconds_x_one_link",
        "origin_x_checkpoint",
        "seconds_x_gloo",
        "cpu_busy_tsukimi",
        "naive_origin_link_busy",
        QUIET_MACHINE,
    }


def _scheduler(report: BenchReport) -> None:
    decision, simulation = report.figures["decision"], report.figures["simulation"]
    assert isinstance(decision, dict) and isinstance(simulation, dict)
    assert decision["p50_us"] <= decision["p99_us"] <= decision["max_us"]
    assert simulation["requests"] > 0 and simulation["pd_s"] > 0
    assert report.verdict("whole_trace").met is not None  # type: ignore[union-attr]


def _cpp(report: BenchReport) -> None:
    medians = report.figures["median_s"]
    assert isinstance(medians, dict) and set(medians) == {"worker", "cpp_k1", "cpp_k2"}
    assert report.verdict("cpp_k2_vs_k1").met is not None  # type: ignore[union-attr]


def _layerwise(report: BenchReport) -> None:
    medians = report.figures["median_ms"]
    assert isinstance(medians, dict) and set(medians) == {"layerwise", "whole", "load_only", "compute_only", "compute"}


def _prefix_link(report: BenchReport) -> None:
    figures = report.figures
    assert report.configuration["model"] == "tiny" and report.configuration["link_rates"] == ["20mbit", "400mbit"]
    hosts = figures["topology"]["hosts"]  # type: ignore[index]
    assert [h["name"] for h in hosts] == ["store", "prefill"] and hosts[0]["address"] != hosts[1]["address"]
    links = figures["links"]
    assert isinstance(links, list) and [row["link_rate"] for row in links] == ["20mbit", "400mbit"]
    for row in links:
        assert row["fetch_ttft_s"] > 0 and row["recompute_ttft_s"] > 0 and row["wire_bytes"] >= row["prefix_bytes"] > 0
        assert row["estimate"]["pick"] in ("fetch", "recompute") and row["estimate"]["fetch_s"] > 0
        assert row["faster"] in ("fetch", "recompute")
        assert row["fits_default_lease"] is True  # NOTE: 4 MiB at >= 20 Mbit/s: under 2 s
    assert figures["cost_model"]["kv_bytes_per_token"] == figures["kv_bytes_per_token"]  # type: ignore[index]
    per_link = {
        f"{goal}_{rate}" for goal in ("fetch_error", "recompute_error", "link_bound") for rate in ("20mbit", "400mbit")
    }
    assert _verdicts(report) == {*per_link, "slow_link_recompute", "fast_link_fetch", QUIET_MACHINE}


def _serve(report: BenchReport) -> None:
    runs = report.figures["runs"]
    assert isinstance(runs, dict) and list(runs) == ["reuse"]
    run = runs["reuse"]
    assert (run["requests"], run["completed"], run["errors"]) == (8, 8, 0)  # chat --quick: 4 x 2
    assert {"ttft_s", "tbt_s", "cached_ratio", "index_exact_ratio", "decision_records"} <= set(run)
    assert report.configuration["chat"] == {**report.configuration["chat"], "conversations": 4, "turns": 2}  # type: ignore[dict-item]
    assert _verdicts(report) >= {"reuse_ttft_p50", "index_exact"}


def _overload(report: BenchReport) -> None:
    figures = report.figures
    kinds = {kind: figures[kind] for kind in ("served", "rejected", "error", "failed")}
    assert sum(kinds.values()) == figures["sent"] and figures["served"] > 0  # type: ignore[arg-type]  # each ended once
    assert figures["failed"] == 0 and figures["failed_by"] == {}  # no hang, no 5xx without a reason
    rejected, errors = figures["rejected_by"], figures["errors_by"]
    assert isinstance(rejected, dict) and isinstance(errors, dict)
    assert all(key.split(" ", 1)[0] in ("429", "503") and key.split(" ", 1)[1] for key in rejected), rejected
    assert all(key.split(" ", 1)[1] for key in errors), errors  # every error names its reason
    post = figures["post_load"]
    assert isinstance(post, dict) and post["ok"], post
    assert set(figures["rss_mib"]) >= {"router", "prefill-0", "decode-0", "master"}  # type: ignore[arg-type]
    health_port, admission = figures["health_port"], figures["admission"]
    assert isinstance(health_port, dict) and health_port["probes"] > 0  # the router's health port
    assert isinstance(admission, dict) and admission["count"] > 0  # read from the decision log
    assert _verdicts(report) == {
        "health_under_100ms",
        "health_port_p99",
        "admission_p99",
        "every_request_ended",
        "tokens_or_429_503",
        "rss_bounded",
        "post_load_ok",
        QUIET_MACHINE,
    }


def _kv_burst(report: BenchReport) -> None:
    figures = report.figures
    assert (figures["requests"], figures["served"], figures["other_errors"]) == (4, 4, 0)
    assert figures["decode_capacity_tokens"] == 64 * 16 and figures["same_tokens_as_sequential"] is True
    outcomes = figures["outcomes"]
    assert isinstance(outcomes, list) and len(outcomes) == 4
    assert _verdicts(report) >= {"ttft_rejections_predicted", "served_within_slo", "same_tokens", "no_other_errors"}


def _sglang(report: BenchReport) -> None:
    rows = report.figures["rows"]
    assert isinstance(rows, list) and [(r["system"], r["op"]) for r in rows] == [
        ("tsukimi", "set"),
        ("tsukimi", "exists"),
        ("tsukimi", "get"),
    ], report.figures
    assert all(r["pages_ok"] == r["pages"] == 128 for r in rows) and report.verdict("byte_exact").met  # type: ignore[union-attr]


def _gpu(report: BenchReport) -> None:
    figures, cuda = report.figures, report.host.device != "cpu"
    assert figures["device"] == report.host.device
    for size in ("64KiB", "1MiB", "64MiB"):
        assert figures[f"raw.memcpy_gbps.{size}"] > 0  # type: ignore[operator]
        pinned = figures[f"raw.h2d_pinned_gbps.{size}"]
        assert (isinstance(pinned, float) and pinned > 0) if cuda else pinned == "not measured: no CUDA"
    assert figures["raw.kv_host_per_block_gbps"] > 0 and figures["raw.kv_host_batched_gbps"] > 0  # type: ignore[operator]
    tokens = ("4k", "16k") if cuda else ("128", "512")
    for label in tokens:
        assert figures[f"raw.prefill_s.{label}"] > 0 and figures[f"raw.reuse_s.{label}"] > 0  # type: ignore[operator]
    for size in ("64KiB", "1MiB"):  # the Transfer Engine with device memory (emulated without CUDA)
        assert figures[f"tsukimi.te_h2d_gbps.{size}"] > 0 and figures[f"tsukimi.te_d2d_gbps.{size}"] > 0  # type: ignore[operator]
        assert figures[f"tsukimi.te.tcp.READ.device_to_device.{size}"] > 0  # type: ignore[operator]
    assert figures["tsukimi.te.auto_carried_by.device_to_device"] == "device_ipc"
    assert figures["tsukimi.store_kv_blocks_gbps"] > 0  # type: ignore[operator]
    assert figures["tsukimi.store_kv_blocks_path"] == ("host" if not cuda else "device (staged, one copy, one scatter)")
    longest = tokens[-1]
    for key in (f"tsukimi.engine_prefill_s.{longest}", f"tsukimi.engine_reuse_s.{longest}"):
        assert figures[key] > 0  # type: ignore[operator]
    assert not [key for key in figures if key.startswith("errors.")], figures
    for mode in ("colocated", "pd", "pd_local_prefix"):
        assert figures[f"tsukimi.{mode}_ttft_s.{longest}"] > 0  # type: ignore[operator]
    assert figures[f"tsukimi.pd_ttft_vs_colocated.{longest}"] > 0  # type: ignore[operator]
    gpu_goals = {
        "te_h2d_vs_pinned",
        "store_kv_blocks_gbps",
        "engine_prefill_vs_raw_16k",
        "engine_reuse_vs_recompute_16k",
        "pd_ttft_vs_colocated_16k",
    }
    assert _verdicts(report) == gpu_goals | {QUIET_MACHINE}
    assert all(report.verdict(name).met is None for name in gpu_goals)  # type: ignore[union-attr]


def _hot_lab(report: BenchReport) -> None:
    figures = report.figures
    assert report.configuration["holders"] == 3 and report.configuration["readers"] == 4
    topo = figures["topology"]
    assert isinstance(topo, dict) and topo["hosts"] == ["m", "h1", "h2", "h3", "r1", "r2", "r3", "r4"]
    assert topo["transport"] == "tcp" and topo["link_rate_bps"] == 100_000_000
    runs = figures["runs"]
    assert isinstance(runs, list) and [r["hot_threshold"] for r in runs] == [0.0, 1.0]
    off, on = runs
    for row in runs:
        assert row["requests"] == 30 and 0 < row["p50_ttft_s"] <= row["p90_ttft_s"], row
        assert row["fetched_bytes"] == row["shared_requests"] * figures["prefix_bytes"]  # type: ignore[operator]
        assert set(row["holder_link_bytes"]) == {"h1", "h2", "h3"} and set(row["holder_cpu_x_core"]) == {
            "h1",
            "h2",
            "h3",
        }
    # NOTE: off, the prompt's only replica is on h1: h1 serves every byte, no copy is made
    assert off["hot_replications"] == 0 and off["prefix_replicas_at_end"] == [1, 1, 1, 1]
    assert off["holder_link_bytes"]["h1"] >= off["fetched_bytes"] > 10 * off["holder_link_bytes"]["h2"]
    assert on["hot_replications"] > 0 and max(on["prefix_replicas_at_end"]) > 1
    assert _verdicts(report) == {
        "p90_ttft_on_x_off",
        "busiest_holder_link_off",
        "cpu_busy_on",
        "holder_cpu_max",
        QUIET_MACHINE,
    }


_SGLANG = pytest.mark.skipif(bool(SGLANG_MISSING), reason=f"no SGLang here: {SGLANG_MISSING}")
_LAB = pytest.mark.skipif(bool(NAMESPACES_REFUSED), reason=f"this machine refuses namespaces: {NAMESPACES_REFUSED}")


def _case(name: str, case: Case, *marks: pytest.MarkDecorator) -> object:
    """One parameter: its id, and a test time bound above the bench's (SIGINT, then a clean stop)."""
    return pytest.param(case, id=name, marks=[pytest.mark.timeout(case.timeout_s + 120), *marks])


CASES = [
    _case(
        "transfer",
        Case(("transfer", "--quick", "--transport", "auto,tcp", "--op", "write", "--connections", "1"), _transfer),
    ),
    _case("store", Case(("store", "--quick", "--api", "single"), _store)),
    _case(
        "p2p",
        Case(
            ("p2p", "--receivers", "1,2", "--size", "8MiB", "--shard", "1MiB", "--timeout", "60", "--repeats", "1"),
            _p2p,
        ),
    ),
    _case("p2p-lab", Case(("p2p", "--lab", "--quick", "--timeout", "60"), _p2p_lab, 90), _LAB),
    _case("transfer-lab", Case(("transfer", "--lab", "--quick"), _transfer_lab, 90), _LAB),
    _case("hot-lab", Case(("hot-lab", "--quick", "--timeout", "60"), _hot_lab, 120), _LAB),
    _case(
        "scheduler",
        Case(
            ("scheduler", "--decisions", "200", "--indexed-blocks", "2000", "--prefill", "4", "--decode", "4"),
            _scheduler,
        ),
    ),
    _case(
        "cpp",
        Case(("cpp", "--prompt-tokens", "300", "--chunk-tokens", "128", "--stages", "1", "2", "--repeats", "1"), _cpp),
    ),
    _case("prefix-link", Case(("prefix-link", "--quick"), _prefix_link, 90), _LAB),
    _case("layerwise", Case(("layerwise", "--prefix-tokens", "64", "--new-tokens", "4", "--repeats", "1"), _layerwise)),
    _case("serve", Case(("serve", "--quick", "--no-compare"), _serve, 200)),
    _case("overload", Case(("serve", "--workload", "overload", "--quick"), _overload, 240)),
    _case(
        "kv-burst",
        Case(
            ("kv-burst", "--requests", "4", "--prompt-tokens", "200", "--max-tokens", "4", "--decode-num-blocks", "64"),
            _kv_burst,
        ),
    ),
    _case("gpu", Case(("gpu", "--quick", "--repeats", "1"), _gpu, 180)),
    _case("sglang", Case(("sglang", "--quick", "--systems", "tsukimi"), _sglang, 180), _SGLANG),
]


def _bench(case: Case) -> tuple[int, str, str]:
    """Runs `tsukimi bench ARGS --json`; its status, stdout and stderr. Past the case's time
    bound it gets SIGINT first (a bench stops what it started on the way out, vLLM servers
    included), SIGKILL only if that does not end it."""
    cmd = [sys.executable, "-m", "tsukimi.cli", "bench", *case.args, "--json"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=case.timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"bench {case.args[0]} ran past {case.timeout_s} s:\n{err[-3000:]}")
    return proc.returncode, out, err


@pytest.mark.parametrize("case", CASES)
def test_every_bench_prints_the_one_report(case: Case) -> None:
    code, out, err = _bench(case)
    assert code == 0, out[-2000:] + err[-3000:]
    flags = ("--workload", "overload") if "overload" in case.args else ("--lab",) if "--lab" in case.args else ()
    report = check_report(BenchReport.from_json(out), "bench " + " ".join(case.args[:1] + flags))
    case.check(report)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


def test_serve_quick_shrinks_every_workload() -> None:
    chat = serve_config(_serve_args("--quick"))
    assert (chat.chat.conversations, chat.chat.turns, chat.chat.prefix_tokens) == (4, 2, 1000)
    skewed = serve_config(_serve_args("--workload", "skewed", "--quick", "--rate", "8"))
    assert (skewed.skewed.requests, skewed.skewed.prefix_tokens, skewed.skewed.rate) == (20, 500, 8.0)
    assert serve_config(_serve_args("--workload", "trace", "--quick")).trace_limit == 20
    overload = overload_config(_serve_args("--workload", "overload", "--quick"))
    assert (overload.duration_s, overload.calibrate_s) == (10.0, 6.0)
    full = serve_config(_serve_args())
    assert (full.chat.conversations, full.chat.turns, full.trace_limit, full.skewed.requests) == (8, 4, 200, 60)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("vllm", "--quick", "--systems", "vllm_rr"), VllmBenchConfig(systems=("vllm_rr",), conversations=2, turns=2)),
        (("vllm-pd", "--quick"), VLLM_PD_QUICK),
    ],
    ids=["vllm", "vllm-pd"],
)
def test_the_vllm_benches_quick_flags(
    argv: tuple[str, ...], expected: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tsukimi bench vllm|vllm-pd --quick --json` hands the bench its quick config and prints
    the report it returns (the bench itself is stubbed: its run is the integration tests')."""
    from tsukimi.bench import runners, vllm, vllm_pd

    seen: list[object] = []

    def fake_report(cfg: object, progress: object = None) -> BenchReport:
        seen.append(cfg)
        return finish(begin(f"bench {argv[0]}", cfg), {"stub": True})

    monkeypatch.setattr(vllm if argv[0] == "vllm" else vllm_pd, "run_report", fake_report)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    runners.run(parser.parse_args(["bench", *argv, "--json"]), Console(file=io.StringIO()))
    assert seen == [expected]
    report = BenchReport.from_json(capsys.readouterr().out)
    assert report.command == f"bench {argv[0]}" and report.figures == {"stub": True}
