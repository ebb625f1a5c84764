"""`mooncake.http_metadata_server` (`python -m mooncake.http_metadata_server`, the wheel's
`mooncake_http_metadata_server`): Mooncake's HTTP metadata server, served by tsukimi's own
(tsukimi/transfer/metadata/http.py: the same /metadata protocol, plus its extensions).

    python -m mooncake.http_metadata_server [--port 8080] [--host 127.0.0.1] [--log-level INFO]

`KVBootstrapServer(port, host)` is the class SGLang's test utilities and Mooncake's scripts
start in a thread (`run()`, `poll()`, `close()`), `KVPoll` its status. One difference: the
host defaults to 127.0.0.1 (tsukimi binds loopback unless told otherwise), not 0.0.0.0; pass
`--host 0.0.0.0` to serve other hosts.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from enum import Enum
from types import FrameType

from tsukimi.errors import TsukimiError
from tsukimi.transfer.metadata.http import ServerHandle, start_in_thread

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8080
DEFAULT_HOST = "127.0.0.1"


class KVPoll(Enum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class KVBootstrapServer:
    """The metadata server on `host:port`, in a daemon thread once `run()` is called."""

    def __init__(self, port: int, host: str = DEFAULT_HOST) -> None:
        self.port, self.host = port, host
        self._handle: ServerHandle | None = None
        self._failed = False

    def run(self) -> threading.Thread | None:
        """Start serving (returns the server's thread; None when it could not start: `poll()`
        then says Failed, and the reason is logged)."""
        try:
            self._handle, self.port = start_in_thread(self.host, self.port)
        except (OSError, TsukimiError) as exc:
            logger.error("the HTTP metadata server cannot serve on %s:%d: %s", self.host, self.port, exc)
            self._failed = True
            return None
        logger.info("HTTP metadata server started on %s:%d", self.host, self.port)
        return self._handle.thread

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._handle is not None:
            self._handle.stop()
            self._handle = None

    def poll(self) -> KVPoll:
        """Success while serving; Failed before `run()`, after `close()` or a failed start."""
        if self._failed or self._handle is None or not self._handle.thread.is_alive():
            return KVPoll.Failed
        return KVPoll.Success


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (`argv`, default sys.argv[1:]): port, host, log_level.

    Raises:
        SystemExit: bad arguments, or --help (argparse's usage message).
    """
    parser = argparse.ArgumentParser(
        prog="python -m mooncake.http_metadata_server",
        description="Mooncake's HTTP metadata server, on tsukimi",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (0.0.0.0: every interface)")
    parser.add_argument(
        "--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], default="INFO", help="logging level"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT or SIGTERM; 0, or 1 when the server cannot start."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    server = KVBootstrapServer(args.port, args.host)
    if server.run() is None:
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop.wait(1.0) and server.poll() is KVPoll.Success:
        pass
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
