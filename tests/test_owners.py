"""tsukimi/owners.py: pid liveness and reaping the files of dead creators."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tsukimi.owners import pid_alive, reap_dead_owners

_NAME = re.compile(r"^thing-(\d+)-[0-9a-f]{4}$")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert pid_alive(1)  # init: alive, whoever owns it
    assert not pid_alive(0)
    assert not pid_alive(-5)
    assert not pid_alive(_dead_pid())


def test_only_files_of_dead_creators_that_match_are_reaped(tmp_path: Path) -> None:
    dead = _dead_pid()
    names = {
        f"thing-{dead}-abcd": False,  # reaped
        f"thing-{os.getpid()}-abcd": True,  # its creator lives
        f"other-{dead}-abcd": True,  # not ours to judge
        f"thing-{dead}-zz": True,  # does not match
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert reap_dead_owners(str(tmp_path), _NAME) == 1
    assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept}


def test_a_missing_directory_reaps_nothing(tmp_path: Path) -> None:
    assert reap_dead_owners(str(tmp_path / "absent"), _NAME) == 0
