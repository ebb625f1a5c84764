"""`tsukimi demo` (what `make demo` runs): the Transfer Engine end to end on this machine.

Starts the embedded HTTP metadata server, then two processes that register with it; the
initiator writes random bytes into the target's memory and reads them back over each
transport, the target confirms what landed, and the bandwidth of each transport is measured.
(Later issues turn this into the serving cluster.)
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tsukimi.bench.transfer import TransferCell, TsukimiPair
from tsukimi.errors import TransferError
from tsukimi.transfer.metadata.http import start_in_thread

MIB = 1 << 20
BLOCK_BYTES = 4 * MIB
BATCH = 4


def run(console: Console, seconds: float = 1.0) -> None:
    """Raises TransferError if any byte did not arrive as sent."""
    with console.status("starting the metadata server and two engine processes"):
        server, port = start_in_thread()
    try:
        url = f"http://127.0.0.1:{port}/metadata"
        pair = TsukimiPair(BLOCK_BYTES * BATCH, url)
        try:
            console.print(
                f"metadata server at {url}; target segment [bold]{pair.target.ready['name']}[/bold] "
                f"(pid {pair.target.pid}), initiator pid {pair.initiator.pid}"
            )
            table = Table(title=f"two processes, {BLOCK_BYTES // MIB} MiB blocks, batches of {BATCH}")
            for column in ("transport", "both ways byte-exact", "write GB/s", "read GB/s"):
                table.add_column(column)
            for transport in ("shm", "tcp"):
                with console.status(f"{transport}: checking bytes both ways, then measuring"):
                    exact = _check(pair, transport)
                    speeds = [
                        pair.measure(TransferCell(transport, op, BLOCK_BYTES, BATCH, 4), seconds, seconds / 4)
                        for op in ("write", "read")
                    ]
                table.add_row(transport, "yes" if exact else "NO", *(f"{s:.2f}" for s in speeds))
            console.print(table)
            console.print("GB/s = 1e9 bytes/s. Full benchmark: tsukimi bench transfer --compare-mooncake")
        finally:
            pair.close()
    finally:
        server.stop()


def _check(pair: TsukimiPair, transport: str) -> bool:
    ready = pair.target.ready
    sent = pair.initiator.call(
        60.0,
        cmd="verify",
        name=ready["name"],
        base=ready["base"],
        transport=transport,
        nbytes=BLOCK_BYTES,
        seed=len(transport),
        connections=4,
    )
    landed = pair.target.call(60.0, offset=0, nbytes=BLOCK_BYTES)
    if not sent["read_back_equal"] or landed["sha256"] != sent["sha256"]:
        raise TransferError(f"{transport}: the bytes that arrived differ from those sent")
    return True
