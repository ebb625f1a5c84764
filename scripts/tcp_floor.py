"""Floors for the tcp transport's 64 KiB x 4 cell (docs/benchmarks.md, "tcp, 64 KiB x 4"):

    .venv/bin/python scripts/tcp_floor.py raw      # a raw Python client and server speaking our frames
    .venv/bin/python scripts/tcp_floor.py server   # the raw client against tsukimi's segment server

Each prints three rounds of 1.5 s, GB/s. `raw` is what Python can do with one sendmsg of
requests and one recv_into per answer header and payload; `server` shows how much of a
transfer's time the segment server takes (the rest of `tsukimi bench transfer`'s time is the
client's).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable

from tsukimi.bench.transfer import own_code_env
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.transports.tcp_connection import connect

BLOCK, BATCH = 64 << 10, 4
REQ, RESP = struct.Struct("<HBBIQQ"), struct.Struct("<HBBIQ")
MAGIC, READ = 0x6D74, 1


def _rounds(sock: socket.socket, base: int) -> None:
    local = memoryview(bytearray(BATCH * BLOCK))
    head = memoryview(bytearray(RESP.size))

    def recv_exact(view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            with contextlib.suppress(BlockingIOError):  # the engine's sockets tick (SO_RCVTIMEO)
                pos += sock.recv_into(view[pos:])

    seq = 0
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < 1.5:
            parts = []
            for i in range(BATCH):
                seq += 1
                parts.append(REQ.pack(MAGIC, READ, 0, seq, base + i * BLOCK, BLOCK))
            sock.sendmsg(parts)
            for i in range(BATCH):
                recv_exact(head)
                recv_exact(local[i * BLOCK : (i + 1) * BLOCK])
            n += 1
        print(f"read {n * BATCH * BLOCK / (time.perf_counter() - start) / 1e9:.2f} GB/s", flush=True)


def raw() -> None:
    memory = memoryview(bytearray(16 << 20))
    server = socket.create_server(("127.0.0.1", 0))
    if os.fork() == 0:  # the raw server: read a batch of headers, answer them in one sendmsg
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        heads = memoryview(bytearray(REQ.size * BATCH))
        while True:
            got = 0
            while got < len(heads):
                chunk = conn.recv_into(heads[got:])
                if not chunk:
                    os._exit(0)
                got += chunk
            answers: list[bytes | memoryview] = []
            for i in range(BATCH):
                _, _, _, seq, offset, length = REQ.unpack_from(heads, REQ.size * i)
                answers += (RESP.pack(MAGIC, 0, 0, seq, length), memory[offset : offset + length])
            conn.sendmsg(answers)
    client = socket.create_connection(server.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _rounds(client, 0)
    client.close()


def against_server() -> None:
    args = [sys.executable, "-m", "tsukimi.bench.child", "transfer-peer", "target", str(16 << 20), "p2p"]
    env = {**os.environ, **own_code_env()}
    target = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert target.stdout is not None and target.stdin is not None
        ready = json.loads(target.stdout.readline())
        with TransferEngine(None, Config(transfer=TransferConfig(), metadata=MetadataConfig(url="p2p"))) as engine:
            endpoint = engine.lookup(ready["name"]).endpoints[0]
            with connect(endpoint, 5.0, None) as sock:
                _rounds(sock, ready["base"])
        target.stdin.close()
    finally:
        target.wait(timeout=10)


MODES: dict[str, Callable[[], None]] = {"raw": raw, "server": against_server}

if __name__ == "__main__":
    MODES[sys.argv[1] if len(sys.argv) > 1 else "server"]()
