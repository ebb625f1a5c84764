"""What the kit's suites assert with, without pytest (a dev-only dependency): `raises`, and
`run_checks`, which runs a list of named checks and says which one failed.

A check is a plain function `check(maker) -> None` that raises AssertionError (or the error
the code under test raised) when the property it is named after does not hold. The test
files parametrize over the checks so that each is its own test; `run_checks` is for callers
without a test runner, and for "run the whole suite against my implementation".
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def raises(expected: type[BaseException] | tuple[type[BaseException], ...], match: str | None = None) -> Iterator[None]:
    """Assert that the block raises `expected` (any other exception propagates unchanged).

    Args:
        expected: the exception type, or a tuple of them.
        match: a regular expression that must be found (`re.search`) in `str(exception)`.
    Raises:
        AssertionError: nothing was raised, or the message does not match.
    """
    try:
        yield
    except expected as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{type(exc).__name__} raised, but {str(exc)!r} does not match {match!r}") from exc
        return
    names = ", ".join(t.__name__ for t in expected) if isinstance(expected, tuple) else expected.__name__
    raise AssertionError(f"did not raise {names}")


def check_name(check: Callable[..., object]) -> str:
    """A check's name, for test ids and messages: its function name."""
    return check.__name__


def run_checks(suite: str, checks: Sequence[Callable[[T], None]], maker: T) -> None:
    """Run every check against `maker`, in order; the first failure propagates, with a note
    naming the suite and the check.

    Args:
        suite: the suite's name, for the note ("transport", "store").
        checks: the suite's checks.
        maker: what each check is given (a factory of the implementation under test).
    """
    for check in checks:
        try:
            check(maker)
        except BaseException as exc:
            exc.add_note(f"in the {suite} check {check_name(check)!r}")
            raise
