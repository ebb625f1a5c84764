"""The command line: the transfer and store benchmarks' reports (the one report type, with the
bench's figures in their documented shape) and the demo, end to end (small)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tsukimi.bench.report import BenchReport
from tsukimi.errors import MetadataError

pytestmark = pytest.mark.timeout(120)


def _tsukimi(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tsukimi.cli", *args], capture_output=True, text=True, timeout=110, check=False
    )


def test_bench_transfer_json_has_the_documented_shape() -> None:
    out = _tsukimi(
        "bench",
        "transfer",
        "--json",
        "--transport",
        "tcp,shm",
        "--op",
        "write,read",
        "--block-sizes",
        "64K",
        "--connections",
        "2",
        "--duration",
        "0.2",
        "--warmup",
        "0.05",
        "--repeats",
        "1",
        "--batch",
        "2",
    )
    assert out.returncode == 0, out.stderr
    parsed = BenchReport.from_json(out.stdout)
    assert parsed.command == "bench transfer" and parsed.configuration["transports"] == ["tcp", "shm"]
    report = parsed.figures
    assert set(report) >= {"results", "baselines", "mooncake", "ratios"}
    assert report["mooncake"] is None
    assert {v.name for v in parsed.verdicts} >= {"tcp_4mib_vs_socket", "quiet_machine"}
    rows = {(r["transport"], r["op"]) for r in report["results"]}
    assert rows == {("tcp", "write"), ("tcp", "read"), ("shm", "write"), ("shm", "read")}
    for row in report["results"]:
        assert set(row) == {"transport", "op", "block_bytes", "batch", "connections", "gbps"}
        assert row["block_bytes"] == 65536 and row["batch"] == 2 and row["gbps"] > 0
    assert report["baselines"]["socket_gbps"] > 0 and report["baselines"]["memcpy_gbps"] > 0


def test_bench_rejects_bad_arguments_clearly() -> None:
    out = _tsukimi("bench", "transfer", "--transport", "rdma", "--quick")
    assert out.returncode == 2 and "transport must be one of auto, shm, cma" in out.stdout + out.stderr
    out = _tsukimi("bench", "transfer", "--block-sizes", "lots")
    assert out.returncode == 2 and "not a size" in out.stderr


def test_demo_moves_bytes_both_ways() -> None:
    out = _tsukimi("demo", "--seconds", "0.2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("yes") == 2 and "shm" in out.stdout and "tcp" in out.stdout


def test_metadata_server_command_serves_and_stops_on_sigterm() -> None:
    from tsukimi.netio import free_port
    from tsukimi.transfer.metadata.http_client import HttpMetadata

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsukimi.cli", "metadata-server", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        client = HttpMetadata(f"http://127.0.0.1:{port}/metadata", timeout_s=1.0)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.put("tsukimi/segments/x", b"descriptor")
                break
            except MetadataError:
                assert time.monotonic() < deadline, "metadata-server did not come up"
                time.sleep(0.1)
        assert client.get("tsukimi/segments/x") == b"descriptor"
        client.close()
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert proc.wait(timeout=10) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


def test_bench_store_quick_json_shape() -> None:
    out = _tsukimi("bench", "store", "--quick", "--json", "--api", "single")
    assert out.returncode == 0, out.stderr[-2000:]
    report = BenchReport.from_json(out.stdout).figures
    assert set(report) >= {"results", "small_ops"}
    for row in report["results"]:
        puts = {"put_gbps", "put_p50_us"} if row["tier"] == "memory" else {"stayed_on_disk"}
        assert {"system", "mode", "api", "value_bytes", "replicas", "tier", "get_gbps", "get_p50_us"} | puts <= set(row)
        assert row["system"] == "tsukimi" and row["mode"] == "shm" and row["get_gbps"] > 0
    assert sorted(r["tier"] for r in report["results"]) == ["disk", "disk", "memory", "memory"]
    assert all(r["stayed_on_disk"] == 1.0 for r in report["results"] if r["tier"] == "disk")
    assert {r["value_bytes"] for r in report["results"]} == {65536, 1 << 20}
    assert report["small_ops"]["tsukimi"]["exists_p50_us"] > 0
