"""What every `tsukimi bench ...` report must hold, whatever the bench: its command, a
configuration, the revision and the host, and the `quiet_machine` verdict agreeing with the load
averages. Shared by tests/bench/test_reports.py (benches run as `tsukimi bench ... --json`) and
the vLLM tests that build the vllm and vllm-pd reports on servers they already run
(tests/integrations)."""

from __future__ import annotations

from tsukimi.bench.report import QUIET_MACHINE, BenchReport


def check_report(report: BenchReport, command: str) -> BenchReport:
    """Asserts the shape every report has; returns the report as read back from its JSON."""
    report = BenchReport.from_json(report.to_json())
    assert report.command == command
    assert report.configuration and report.revision and report.host.cpus >= 1 and report.host.device
    assert len(report.host.load_avg_start) == len(report.host.load_avg_end) == 3
    quiet = report.verdict(QUIET_MACHINE)
    assert quiet is not None and quiet.met == (
        max(report.host.load_avg_start[0], report.host.load_avg_end[0]) <= report.host.cpus
    )
    assert quiet.met or "loaded machine: figures not comparable with quiet runs" in quiet.detail
    return report


def verdict_names(report: BenchReport) -> set[str]:
    """The names of the report's verdicts (pure)."""
    return {v.name for v in report.verdicts}
