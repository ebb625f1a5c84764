"""`tsukimi compat ...`: run code and deployments written for Mooncake on tsukimi.

    tsukimi compat mooncake-master [mooncake_master's own flags]   master + HTTP metadata server
    tsukimi compat mooncake-client [mooncake_client's own flags]   the standalone client dummies use
    tsukimi compat exec -- CMD [ARGS]                                CMD sees `mooncake.*` as tsukimi

`exec` runs CMD with a generated path entry first on PYTHONPATH (tsukimi/compat/mooncake/
shim.py): `import mooncake.store` then gives tsukimi's modules, in CMD and in every Python
process it starts. CMD's exit status is returned; SIGINT/SIGTERM are passed on to it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from rich.console import Console

from tsukimi.errors import ConfigError

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `tsukimi compat` on the CLI's subparsers (mutates `sub`)."""
    compat = sub.add_parser("compat", help="run code and deployments written for Mooncake").add_subparsers(
        dest="compat", required=True
    )
    # NOTE: prefix "+": mooncake_master's --flags are not ours to parse; they all go to `flags`
    master = compat.add_parser("mooncake-master", help="a master taking mooncake_master's flags", prefix_chars="+")
    master.add_argument("flags", nargs=argparse.REMAINDER, help="mooncake_master's flags (--rpc_port=... ...)")
    client = compat.add_parser(
        "mooncake-client", help="a store client holding memory for Mooncake's dummy clients", prefix_chars="+"
    )
    client.add_argument("flags", nargs=argparse.REMAINDER, help="mooncake_client's flags (--port=... ...)")
    run = compat.add_parser("exec", help="run a command in which `import mooncake` is tsukimi")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS]")


def run(args: argparse.Namespace, console: Console) -> int:
    """Run `tsukimi compat ...`; the exit status. Raises ConfigError for bad flags."""
    if args.compat == "mooncake-master":
        from tsukimi.compat.mooncake.master_service import serve

        serve(args.flags, console)
        return 0
    if args.compat == "mooncake-client":
        from tsukimi.compat.mooncake import client_service

        client_service.serve(args.flags, console)
        return 0
    if args.compat == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise ConfigError("tsukimi compat exec needs a command: tsukimi compat exec -- CMD [ARGS]")
        return run_with_mooncake(cmd)
    raise ConfigError(f"unknown compat command {args.compat!r}")


def run_with_mooncake(cmd: list[str]) -> int:
    """Run `cmd` with `mooncake.*` resolving to tsukimi; its exit status (128 + n when
    killed by signal n). Signals to this process are passed on."""
    from tsukimi.compat.mooncake import shim

    with tempfile.TemporaryDirectory(prefix="tsukimi-mooncake-") as directory:
        entry = shim.path_entry(Path(directory))
        paths = [str(entry), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        try:
            child = subprocess.Popen(cmd, env=env)
        except OSError as exc:
            raise ConfigError(f"cannot run {cmd[0]!r}: {exc}") from exc
        forwarded = _forward_signals(child)
        try:
            code = child.wait()
        finally:
            for signum, handler in forwarded.items():
                signal.signal(signum, handler)
    return code if code >= 0 else 128 - code


def _forward_signals(child: subprocess.Popen[bytes]) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda n, _frame: child.send_signal(n))
    return previous


def main() -> None:  # pragma: no cover - `python -m tsukimi.compat.commands` for debugging
    sys.exit(run_with_mooncake(sys.argv[1:]))
