"""Mooncake's own Python tests, every file, against tsukimi and (optionally) the real wheel.

    python -m tsukimi.testing.mooncake_suite --tests-dir DIR                        # tsukimi vs the reference
    python -m tsukimi.testing.mooncake_suite --tests-dir DIR --modes real,tsukimi   # both, side by side
    python -m tsukimi.testing.mooncake_suite --tests-dir DIR --modes real --record  # refresh the reference

DIR holds Mooncake's tests with the shared `run.sh` (`--tests-dir`, else $MOONCAKE_TESTS; the
Makefile passes ../shared/mooncake-tests). The suite runs from a tsukimi checkout (`--checkout`,
default the current directory): its tests/compat holds the plugins the files need and the
reference, and it goes first on the children's PYTHONPATH.

Each file runs through `run.sh` (unchanged; the same master flags for both modes) on free
ports, with what the file needs beside the master: the offload flags and environment of the
disk-tier files, the Transfer Engine target, the dummy client. Per test outcomes come from
pytest's JUnit XML. The reference (tests/compat/mooncake_reference.json) is the set of tests the
real wheel passed here; the run fails when tsukimi does not pass one of them. Exit status: 0 all
reference tests passed on tsukimi, 1 some did not, 2 the tests or the checkout are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tsukimi.errors import ConfigError
from tsukimi.netio import free_port

TESTS_ENV = "MOONCAKE_TESTS"
REFERENCE = Path("tests") / "compat" / "mooncake_reference.json"  # in the checkout
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


@dataclass(frozen=True, slots=True)
class SuitePaths:
    """Where the run's files are: Mooncake's tests (with run.sh) and the tsukimi checkout (both
    absolute)."""

    tests: Path
    checkout: Path


def suite_paths(tests: str, checkout: str) -> SuitePaths:
    """The paths the flags name (see the module).

    Args:
        tests: `--tests-dir` ("" for $MOONCAKE_TESTS).
        checkout: `--checkout`.
    Raises:
        ConfigError: Mooncake's tests or the checkout are not where they were said to be (the
            message names the flag and the variable).
    """
    where = tests or os.environ.get(TESTS_ENV, "")
    if not where:
        raise ConfigError(
            f"where are Mooncake's tests? pass --tests-dir DIR or set ${TESTS_ENV} (a folder with run.sh)"
        )
    if not (Path(where) / "run.sh").is_file():
        raise ConfigError(f"no run.sh in {where} (--tests-dir / ${TESTS_ENV}): not Mooncake's tests")
    if not (Path(checkout) / "tests" / "compat").is_dir():
        raise ConfigError(
            f"{checkout} is not a tsukimi checkout (no tests/compat): run from one or pass --checkout DIR"
        )
    return SuitePaths(Path(where).absolute(), Path(checkout).absolute())


def run_file(where: SuitePaths, spec: SuiteFile, mode: str, logs: Path) -> tuple[dict[str, str], float]:
    """Run one file in `mode`: ({test id: passed | failed | error | skipped}, seconds)."""
    disk = tempfile.mkdtemp(prefix="mooncake-suite-disk-")
    report = logs / f"{mode}-{spec.name.replace('/', '_')}.xml"
    env = dict(
        os.environ,
        MODE=mode,
        PYTHONPATH=str(where.checkout),
        RPC_PORT=str(free_port()),
        MD_PORT=str(free_port()),
        METRICS_PORT=str(free_port()),
        MASTER_EXTRA=spec.master_flags.format(disk=disk),
        MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=disk,
        **spec.env,
    )
    args = ["bash", str(where.tests / "run.sh"), spec.name, f"--junitxml={report}", "-p", "no:randomly"]
    for plugin in spec.plugins:
        args += ["-p", plugin]
    started = time.monotonic()
    try:
        for _ in range(2):  # NOTE: once more when pytest never ran (run.sh gives a master 20 s to come up)
            with open(logs / f"{mode}-{spec.name.replace('/', '_')}.log", "ab") as log:
                subprocess.run(args, cwd=where.checkout, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
            if report.exists():
                break
    finally:
        shutil.rmtree(disk, ignore_errors=True)
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
    """`python -m tsukimi.testing.mooncake_suite`: the table; the exit status of the module."""
    parser = argparse.ArgumentParser(
        prog="python -m tsukimi.testing.mooncake_suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tests-dir", default="", help=f"Mooncake's tests, with run.sh (default: ${TESTS_ENV})")
    parser.add_argument("--checkout", default=".", help="the tsukimi checkout (default: the current directory)")
    parser.add_argument("--modes", default="tsukimi", help="comma-separated: tsukimi, real")
    parser.add_argument("--files", default="", help="comma-separated file names (default: all)")
    parser.add_argument("--record", action="store_true", help="write the real wheel's passes as the reference")
    args = parser.parse_args(argv)
    console = Console(width=140)
    try:
        where = suite_paths(args.tests_dir, args.checkout)
    except ConfigError as exc:
        console.print(f"error: {escape(str(exc))}")
        return 2
    modes = [m for m in args.modes.split(",") if m]
    files = [f for f in FILES if not args.files or f.name in args.files.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="mooncake-suite-"))
    reference_file = where.checkout / REFERENCE
    reference: dict[str, list[str]] = json.loads(reference_file.read_text()) if reference_file.exists() else {}
    table = Table("file", *[f"{m} passed" for m in modes], "reference", "missing on tsukimi", "seconds")
    missing_all: list[str] = []
    for spec in files:
        results = {mode: run_file(where, spec, mode, logs) for mode in modes}
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
        reference_file.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
    console.print(table)
    for line in missing_all:
        console.print(f"[red]passes on the real wheel, not on tsukimi[/red] {line}")
    console.print(f"logs and JUnit reports: {logs}")
    return 1 if missing_all else 0


if __name__ == "__main__":
    sys.exit(main())
