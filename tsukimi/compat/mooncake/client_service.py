"""`tsukimi compat mooncake-client`: the standalone store client Mooncake's `mooncake_client`
is, taking its flags (client_flags.py): it contributes `--global_segment_size` of memory to
the store and answers dummy clients (`setup_dummy`, dummy.py) on `--host:--port` with where
the store is, until SIGINT or SIGTERM.

    tsukimi compat mooncake-client --host=127.0.0.1 --port=50052 \\
        --master_server_address=127.0.0.1:50051 --metadata_server=http://127.0.0.1:8080/metadata
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence

import msgspec
from rich.console import Console

from tsukimi.compat.mooncake import dummy
from tsukimi.compat.mooncake.client_flags import parse
from tsukimi.compat.mooncake.setup_args import StoreSetup, connect
from tsukimi.errors import InvalidArgument
from tsukimi.rpc import RpcServer

logger = logging.getLogger(__name__)


class ClientService:
    """A store client holding the memory, and the RPC server dummies ask (close() when done)."""

    def __init__(self, setup: StoreSetup, port: int) -> None:
        """Raises ConfigError (the port is taken), and what StoreClient raises."""
        self.client = connect(setup)
        self._welcome = dummy.Welcome(
            setup.master, setup.metadata_url, setup.transport, setup.nixl, self.client.engine.name
        )
        try:
            self.rpc = RpcServer(dummy.CODEC, self._handle, bind=f"tcp://{setup.host}:{port}", name="mooncake-client")
        except BaseException:
            self.client.close()
            raise

    def _handle(self, request: msgspec.Struct) -> msgspec.Struct:
        if not isinstance(request, dummy.Hello):
            raise InvalidArgument(f"mooncake-client does not handle {type(request).__name__}")
        logger.info("dummy client (pid %d) joined", request.pid)
        return self._welcome

    def close(self) -> None:
        """Stop answering dummies, then unmount the memory (objects in it are gone)."""
        self.rpc.close()
        self.client.close()


def serve(argv: Sequence[str], console: Console) -> None:
    """Run until SIGINT or SIGTERM (call from the main thread).

    Raises:
        ConfigError: a flag tsukimi does not know, a bad value, a port taken.
    """
    flags = parse(argv)
    if flags.ignored:
        logger.warning("mooncake_client flags with no meaning in tsukimi, ignored: %s", ", ".join(flags.ignored))
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        service = ClientService(flags.setup, flags.port)
        try:
            console.print(
                f"tsukimi mooncake-client {service.client.engine.name}: {flags.setup.global_segment_size} bytes "
                f"mounted, dummy clients on {service.rpc.endpoint}",
                highlight=False,
            )
            stop.wait()
        finally:
            service.close()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
