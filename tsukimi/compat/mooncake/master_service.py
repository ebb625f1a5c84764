"""`tsukimi compat mooncake-master`: tsukimi's store master (and, with
--enable_http_metadata_server, the HTTP metadata server Mooncake's clients publish their
segments to), configured by `mooncake_master`'s own flags (master_flags.py)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence

from rich.console import Console

from tsukimi.compat.mooncake.master_flags import parse
from tsukimi.store.master.server import MasterServer
from tsukimi.transfer.metadata import http

logger = logging.getLogger(__name__)


def serve(argv: Sequence[str], console: Console) -> None:
    """Run until SIGINT or SIGTERM (call from the main thread).

    Raises:
        ConfigError: a flag tsukimi does not know, or a bad value.
        OSError: a port cannot be bound.
    """
    flags = parse(argv)
    if flags.ignored:
        logger.warning("mooncake_master flags with no meaning in tsukimi, ignored: %s", ", ".join(flags.ignored))
    settings = flags.master
    if settings.offload != "off":
        logger.info(
            "SSD offload %s (promotion on hit: %s), client disks under %r",
            settings.offload,
            settings.promotion_on_hit,
            settings.disk_root or "their own directories",
        )
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    metadata = None
    try:
        if flags.metadata_server:
            metadata, _ = http.start_in_thread(flags.metadata_host, flags.metadata_port)
        master = MasterServer(flags.master)
        try:
            where = f"rpc {flags.master.host}:{master.rpc.port}"
            extra = f", metadata {metadata.url}" if metadata is not None else ""
            console.print(f"tsukimi master for Mooncake clients: {where}{extra}", highlight=False)
            stop.wait()
        finally:
            master.close()
    finally:
        if metadata is not None:
            metadata.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
