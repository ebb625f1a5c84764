"""Where `python -m tsukimi.testing.mooncake_suite` finds Mooncake's tests and the checkout: from
`--tests-dir` (else $MOONCAKE_TESTS) and `--checkout` (else the current directory), never from
where tsukimi is installed; a missing one ends the run with status 2 and says what to pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from tsukimi.errors import ConfigError
from tsukimi.testing.mooncake_suite import TESTS_ENV, SuitePaths, main, suite_paths

CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mooncake_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with a run.sh; $MOONCAKE_TESTS unset."""
    monkeypatch.delenv(TESTS_ENV, raising=False)
    (tmp_path / "run.sh").touch()
    return tmp_path


def test_the_flag_else_the_variable(mooncake_tests: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert suite_paths(str(mooncake_tests), str(CHECKOUT)) == SuitePaths(mooncake_tests, CHECKOUT)
    monkeypatch.setenv(TESTS_ENV, str(mooncake_tests))
    monkeypatch.chdir(CHECKOUT)
    assert suite_paths("", ".") == SuitePaths(mooncake_tests, CHECKOUT)  # NOTE: made absolute


def test_what_is_missing_is_named(mooncake_tests: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"pass --tests-dir DIR or set \$MOONCAKE_TESTS"):
        suite_paths("", str(CHECKOUT))
    with pytest.raises(ConfigError, match=rf"no run.sh in {CHECKOUT} \(--tests-dir / \$MOONCAKE_TESTS\)"):
        suite_paths(str(CHECKOUT), str(CHECKOUT))
    with pytest.raises(ConfigError, match=r"is not a tsukimi checkout \(no tests/compat\): .* --checkout DIR"):
        suite_paths(str(mooncake_tests), str(tmp_path))
    assert main(["--tests-dir", str(mooncake_tests), "--checkout", str(tmp_path)]) == 2
    assert "is not a tsukimi checkout" in capsys.readouterr().out
