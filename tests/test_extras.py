"""The optional dependencies (tsukimi/extras.py, pyproject's extras): without them the product
imports and runs, and what needs one fails at once with an error naming the extra to install.
(A module set to None in sys.modules is one that is not installed.)"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from tsukimi import cli, extras
from tsukimi.errors import ConfigError
from tsukimi.sim import plots

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "traces" / "conversation_sample.jsonl"


def test_the_extras_are_pyprojects_and_dev_installs_them() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {spec.split(">")[0].split("=")[0] for spec in project["dependencies"]}
    assert names.isdisjoint({"h11", "matplotlib"})  # NOTE: `pip install tsukimi` serves without them
    optional = project["optional-dependencies"]
    assert {extra: tuple(spec.split(">")[0] for spec in optional[extra]) for extra in extras.EXTRAS} == extras.EXTRAS
    assert "tsukimi[bench,plots]" in optional["dev"]


def test_a_missing_extra_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "h11", None)
    with pytest.raises(ConfigError, match=r"tsukimi bench needs h11, .*: pip install 'tsukimi\[bench\]'$"):
        extras.require("bench", "tsukimi bench")
    extras.require("plots", "a test")  # installed here (make test installs .[dev])


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())  # NOTE: rich wraps long lines


def test_tsukimi_bench_without_h11_says_which_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "h11", None)
    code, output = _cli(["bench", "scheduler"], capsys)
    assert (code, output) == (2, "error: tsukimi bench needs h11, which is not installed: pip install 'tsukimi[bench]'")


def test_plots_without_matplotlib_say_which_extra_before_simulating(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'tsukimi\[plots\]'"):
        plots.pyplot()
    png = tmp_path / "load.png"
    code, output = _cli(["sim", "run", "--trace", str(SAMPLE), "--plot", str(png)], capsys)
    assert (code, output) == (
        2,
        "error: tsukimi sim run --plot needs matplotlib, which is not installed: pip install 'tsukimi[plots]'",
    )
    assert not png.exists()
    code, output = _cli(["sim", "experiment", "1", "--trace", str(SAMPLE), "--plots", str(tmp_path)], capsys)
    assert code == 2 and output.endswith("pip install 'tsukimi[plots]'")
