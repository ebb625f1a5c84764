"""`mooncake.cli_client` on tsukimi: the wheel's `mooncake_client` entry point, which here runs
`tsukimi compat mooncake-client` with the same flags (client_flags.py reads them), replacing
the process as the wheel does."""

from __future__ import annotations

import sys

from tsukimi.compat.mooncake.cli import exec_compat


def main() -> None:
    """Run `tsukimi compat mooncake-client` with this process's arguments (sys.argv[1:]);
    does not return. Raises OSError when the interpreter cannot be executed."""
    exec_compat("mooncake-client", sys.argv[1:])


if __name__ == "__main__":
    main()
