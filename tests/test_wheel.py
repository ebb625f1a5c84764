"""The product without its checkout: the wheel, installed with its dependencies (and none of the
extras) into a fresh venv outside the checkout, runs `tsukimi up --model tiny` from a directory
of its own, with no PYTHONPATH, and answers a completion; SIGTERM then stops every process.

What it needs from the network is PyPI's (through pip's cache after the first run); torch is the
pinned CPU wheel pip finds on this disk. About a minute on 2 CPUs: the build 2 s, the venv and
the install 30 s (torch unpacked, nothing byte-compiled ahead), `tsukimi up` and the
completion the rest.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tsukimi.netio import free_port
from tsukimi.testing.processes import wait_until

CHECKOUT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # NOTE: pyproject's pin, named first so that pip takes the local CPU wheel
SOURCES = ("pyproject.toml", "README.md", "tsukimi")
pytestmark = pytest.mark.timeout(600)


def _pip(*args: str, cwd: Path) -> None:
    """Run this interpreter's pip (its cache, its configuration); fail with its output."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def build_wheel(out: Path) -> Path:
    """The wheel of a copy of the checkout's sources (a build leaves build/ and egg-info behind).

    NOTE: without build isolation when this venv's setuptools meets pyproject's (fast, offline),
    else isolated (pip fetches setuptools from PyPI).
    """
    source = out / "source"
    source.mkdir()
    for name in SOURCES:
        item = CHECKOUT / name
        if item.is_dir():
            shutil.copytree(item, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(item, source / name)
    flags = ["--no-build-isolation"] if _setuptools_major() >= 68 else []
    _pip("wheel", "--no-deps", *flags, "--wheel-dir", str(out / "dist"), str(source), cwd=out)
    [wheel] = (out / "dist").glob("tsukimi-*.whl")
    return wheel


def _setuptools_major() -> int:
    """This venv's setuptools major version (0: none)."""
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A venv at `where` with the wheel and its dependencies installed; its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    _pip("--python", str(python), "install", "--quiet", "--no-compile", TORCH, str(wheel), cwd=where.parent)
    return where / "bin"


def _clean_env() -> dict[str, str]:
    """This environment without what would import the checkout or point tsukimi anywhere."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TSUKIMI_")}


def test_the_wheel_in_a_fresh_venv_serves_a_completion(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = {info.filename.split("/")[0] for info in archive.infolist()}
    assert names == {"tsukimi", wheel.name.split("-py3")[0] + ".dist-info"}  # NOTE: no tests/, no data/
    bin_dir = fresh_venv(tmp_path / "venv", wheel)
    env = _clean_env()
    probe = "import importlib.util as u, tsukimi; print(tsukimi.__file__, u.find_spec('matplotlib') is None)"
    done = subprocess.run([str(bin_dir / "python"), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    where, no_matplotlib = done.stdout.split()
    assert where.startswith(str(tmp_path / "venv")) and no_matplotlib == "True", done.stderr  # no extras

    run = tmp_path / "run"
    run.mkdir()
    state, port = run / "state.json", free_port()
    argv = [str(bin_dir / "tsukimi"), "up", "--model", "tiny", "--port", str(port), "--state-file", str(state)]
    argv += ["--set", "workers.num_blocks=64", "--set", f'log_dir="{run / "logs"}"']
    with (run / "up.log").open("wb") as log:
        up = subprocess.Popen(argv, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: state.exists() or up.poll() is not None, 240, 0.2)
        assert up.poll() is None, (run / "up.log").read_text()[-3000:]
        processes = json.loads(state.read_text())["processes"]
        request = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=request, timeout=60)
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] >= 1
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, (run / "up.log").read_text()[-3000:]
        assert [p["name"] for p in processes if _alive(p["pid"])] == []
    finally:
        if up.poll() is None:  # NOTE: its children stop with it (tsukimi/lifeline.py)
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
