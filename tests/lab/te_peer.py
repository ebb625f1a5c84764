"""A Transfer Engine in one emulated host, for tests/lab (run inside a host by the lab).

python te_peer.py serve ADDR SIZE     a segment of SIZE bytes of shared memory holding
                                      pattern(SIZE, 1); prints {"name", "base", "host_id"};
                                      serves until stdin closes
python te_peer.py client ADDR NAME BASE SIZE
                                      reads the peer's segment and writes it; prints one JSON
                                      line per step, each after a line on stdin ("go")
"""

from __future__ import annotations

import json
import sys

from tsukimi.config import Config, TransferConfig
from tsukimi.errors import TsukimiError
from tsukimi.transfer.engine import TransferEngine
from tsukimi.transfer.segment import host_id


def pattern(size: int, seed: int) -> bytes:
    return bytes((i * 31 + seed * 7) % 251 for i in range(size))


def _say(**obj: object) -> None:
    print(json.dumps(obj), flush=True)


def _engine(addr: str) -> TransferEngine:
    transfer = TransferConfig(bind_host=addr, timeout_s=3.0, connect_timeout_s=1.0, max_retries=0)
    return TransferEngine(config=Config(transfer=transfer))


def serve(addr: str, size: int) -> None:
    engine = _engine(addr)
    buf = engine.allocate(size)
    buf.view[:] = pattern(size, 1)
    _say(name=engine.name, base=buf.base, host_id=host_id())
    sys.stdin.read()
    engine.close()


def client(addr: str, name: str, base: int, size: int) -> None:
    engine = _engine(addr)
    peer = engine.open_segment(name)
    transport = engine.transport_for(peer, base, size)
    for step in sys.stdin:  # NOTE: one attempt per "go": the test changes the links in between
        seed = int(step)
        got = bytearray(size)
        try:
            engine.read(peer, base, got)
            ok_read = got == pattern(size, seed)
            engine.write(peer, base, pattern(size, seed + 1))
            engine.read(peer, base, got)
            _say(ok=ok_read and got == pattern(size, seed + 1), transport=transport, host_id=host_id())
        except TsukimiError as exc:
            _say(ok=False, error=f"{type(exc).__name__}: {exc}")
    engine.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
