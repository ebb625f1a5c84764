"""`tsukimi bench transfer`'s children import the driver's tsukimi, not the one in their
working directory (tsukimi/bench/transfer.py's own_code_env; issue 27's "before" figures
measured the working directory's code)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tsukimi
from tsukimi.bench.transfer import own_code_env


def test_a_child_in_another_checkout_imports_the_drivers_tsukimi(tmp_path: Path) -> None:
    (tmp_path / "tsukimi").mkdir()
    (tmp_path / "tsukimi" / "__init__.py").write_text("")  # what `python -m` would find first
    env = {**os.environ, **own_code_env(str(tmp_path / "elsewhere"))}
    where = subprocess.run(
        [sys.executable, "-c", "import tsukimi; print(tsukimi.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    assert where == str(Path(tsukimi.__file__).resolve())
    assert env["PYTHONPATH"].endswith(os.pathsep + str(tmp_path / "elsewhere"))
