"""`mooncake.cli` on tsukimi: the wheel's `mooncake_master` entry point, which here runs
`tsukimi compat mooncake-master` with the same flags (master_flags.py reads them).

As in the wheel, `main` replaces the process (os.execv), so the caller's process id is the
master's and stopping it stops the master. `exec_compat` is shared with cli_client.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main() -> None:
    """Run `tsukimi compat mooncake-master` with this process's arguments (sys.argv[1:]);
    does not return. Raises OSError when the interpreter cannot be executed."""
    exec_compat("mooncake-master", sys.argv[1:])


def exec_compat(command: str, flags: Sequence[str]) -> None:
    """Replace this process with `tsukimi compat <command> <flags...>`, run by this interpreter.

    Args:
        command: the `tsukimi compat` subcommand, e.g. "mooncake-master".
        flags: the arguments passed through (Mooncake's gflags, e.g. "--rpc_port=50051").

    Raises:
        OSError: the interpreter cannot be executed (os.execv's error; otherwise no return).
    """
    argv = [sys.executable, "-m", "tsukimi.cli", "compat", command, *flags]
    sys.stdout.flush()  # NOTE: execv drops Python's buffers
    sys.stderr.flush()
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
