"""Mooncake's own Python tests, every file, against tsukimi and (optionally) the real wheel.

    python -m tsukimi.testing.mooncake_suite                      # tsukimi, checked against the reference
    python -m tsukimi.testing.mooncake_suite --modes real,tsukimi # both, side by side
    python -m tsukimi.testing.mooncake_suite --modes real --record  # refresh the reference

Each file runs through the shared `run.sh` (../shared/mooncake-tests, unchanged; the same master
flags for both modes) on free ports, with what the file needs beside the master: the offload
flags and environment of the disk-tier files, the Transfer Engine target, the dummy client. Per
test outcomes come from pytest's JUnit XML. The reference (tests/compat/mooncake_reference.json)
is the set of tests the real wheel passed here; the run fails when tsukimi does not pass one of
them. Exit status: 0 all reference tests passed on tsukimi, 1 some did not, 2 the tests are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tsukimi.netio import free_port

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "compat" / "mooncake_reference.json"
_OFFLOAD = "--enable_offload=true --root_fs_dir={disk}"


@dataclass(frozen=True, slots=True)
class SuiteFile:
    """One test file and what it needs beside the master."""

    name: str
    master_flags: str = ""  # {disk}: a fresh directory
    plugins: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


FILES = (
    SuiteFile("test_distributed_object_store.py"),
    SuiteFile("test_replicated_distributed_object_store.py"),
    SuiteFile("test_batch_replica_clear.py"),
    SuiteFile("test_put_get_tensor.py"),
    SuiteFile("test_dummy_client.py", plugins=("tests.compat.mooncake_dummy_client",)),
    SuiteFile("test_offload_on_eviction.py", _OFFLOAD + " --offload_on_evict=true"),
    SuiteFile(
        "test_promotion_on_hit.py",
        _OFFLOAD + " --offload_on_evict=true --promotion_on_hit=true --promotion_admission_threshold=1",
        env={"MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "10", "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": "10485760"},
    ),
    SuiteFile("test_ssd_offload_in_evict.py", _OFFLOAD),
    SuiteFile("transfer_engine_initiator_test.py", plugins=("tests.compat.mooncake_te_target",)),
    SuiteFile("scripts/test_upsert_api.py"),
)


def tests_dir() -> Path | None:
    """Where Mooncake's tests are: $MOONCAKE_TESTS, ../shared/mooncake-tests, /work/shared/..."""
    for candidate in (
        os.environ.get("MOONCAKE_TESTS", ""),
        ROOT.parent / "shared" / "mooncake-tests",
        "/work/shared/mooncake-tests",
    ):
        if candidate and (Path(candidate) / "run.sh").exists():
            return Path(candidate)
    return None


def run_file(suite: Path, spec: SuiteFile, mode: str, logs: Path) -> tuple[dict[str, str], float]:
    """Run one file in `mode`: ({test id: passed | failed | error | skipped}, seconds)."""
    disk = tempfile.mkdtemp(prefix="mooncake-suite-disk-")
    report = logs / f"{mode}-{spec.name.replace('/', '_')}.xml"
    env = dict(
        os.environ,
        MODE=mode,
        PYTHONPATH=str(ROOT),
        RPC_PORT=str(free_port()),
        MD_PORT=str(free_port()),
        METRICS_PORT=str(free_port()),
        MASTER_EXTRA=spec.master_flags.format(disk=disk),
        MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=disk,
        **spec.env,
    )
    args = ["bash", str(suite / "run.sh"), spec.name, f"--junitxml={report}", "-p", "no:randomly"]
    for plugin in spec.plugins:
        args += ["-p", plugin]
    started = time.monotonic()
    for _ in range(2):  # NOTE: once more when pytest never ran (run.sh gives a master 20 s to come up)
        with open(logs / f"{mode}-{spec.name.replace('/', '_')}.log", "ab") as log:
            subprocess.run(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
        if report.exists():
            break
    return _outcomes(report), time.monotonic() - started


def _outcomes(report: Path) -> dict[str, str]:
    if not report.exists():
        return {}
    out: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = (
            "failed"
            if "failure" in kinds
            else "error"
            if "error" in kinds
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        out[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tsukimi.testing.mooncake_suite", description=__doc__)
    parser.add_argument("--modes", default="tsukimi", help="comma-separated: tsukimi, real")
    parser.add_argument("--files", default="", help="comma-separated file names (default: all)")
    parser.add_argument("--record", action="store_true", help="write the real wheel's passes as the reference")
    args = parser.parse_args(argv)
    console = Console(width=140)
    suite = tests_dir()
    if suite is None:
        console.print("Mooncake's tests not found (set MOONCAKE_TESTS, or put them in ../shared/mooncake-tests)")
        return 2
    modes = [m for m in args.modes.split(",") if m]
    files = [f for f in FILES if not args.files or f.name in args.files.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="mooncake-suite-"))
    reference: dict[str, list[str]] = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    table = Table("file", *[f"{m} passed" for m in modes], "reference", "missing on tsukimi", "seconds")
    missing_all: list[str] = []
    for spec in files:
        results = {mode: run_file(suite, spec, mode, logs) for mode in modes}
        if args.record and "real" in results:
            reference[spec.name] = sorted(t for t, o in results["real"][0].items() if o == "passed")
        expected = set(reference.get(spec.name, []))
        missing = (
            sorted(expected - {t for t, o in results["tsukimi"][0].items() if o == "passed"})
            if ("tsukimi" in results)
            else []
        )
        missing_all += [f"{spec.name}: {test}" for test in missing]
        cells = [f"{sum(o == 'passed' for o in r.values())}/{len(r)}" for r, _ in results.values()]
        seconds = " ".join(f"{s:.0f}" for _, s in results.values())
        table.add_row(spec.name, *cells, str(len(expected)), str(len(missing)), seconds)
        console.print(f"{spec.name}: {' | '.join(cells)} ({seconds} s)")
    if args.record:
        REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
    console.print(table)
    for line in missing_all:
        console.print(f"[red]passes on the real wheel, not on tsukimi[/red] {line}")
    console.print(f"logs and JUnit reports: {logs}")
    return 1 if missing_all else 0


if __name__ == "__main__":
    sys.exit(main())
